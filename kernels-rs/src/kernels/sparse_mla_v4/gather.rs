//! Key blocks of `sparse_mla_v4`: the walk over a token's main ‖ extra index list (per
//! warp, with ballots), the gather of each key's 512-d row into shared memory as bf16
//! (MODEL1 codes times their tile's ue8m0 scale, exactly), and the staging of the queries.

use super::{chunk_addr, code_addr, BN, D, KS_OFF, Q_OFF, THREADS, TPK, V4_HEADS};
use crate::fp8::e4m3x8_to_bf16;
use crate::global::{GlobalPtr, V2, V4};
use crate::kernels::FULL;
use crate::mx::ue8m0_to_f32;
use crate::params::{kv_format, SparseMlaV4Params, V4CacheParams};
use crate::simt::Simt;

/// Position of the `n`-th (from 0) set bit of `m` (`n < popc(m)`).
#[inline(always)]
fn nth_set_bit(mut m: u32, mut n: u32) -> u32 {
    let mut pos = 0;
    let mut w = 16;
    while w > 0 {
        let c = (m & ((1u32 << w) - 1)).count_ones();
        if n >= c {
            n -= c;
            m >>= w;
            pos += w;
        }
        w >>= 1;
    }
    pos
}

/// The indices a token uses of each cache.
#[derive(Clone, Copy)]
pub(super) struct Lens {
    main: u32,
    extra: u32,
}

impl Lens {
    /// Loads token `token`'s lengths (all `topk` without a lengths array).
    ///
    /// # Safety
    /// `token < n_tokens`.
    #[inline(always)]
    pub(super) unsafe fn load<S: Simt>(p: &SparseMlaV4Params, token: u32) -> Self {
        let of = |c: &V4CacheParams| {
            if c.lengths.is_null() {
                c.topk
            } else {
                // SAFETY: token < n_tokens and `lengths` holds n_tokens entries.
                unsafe { S::gld(c.lengths.add(token as usize)) }
            }
        };
        Lens {
            main: of(&p.main),
            extra: of(&p.extra),
        }
    }
}

/// The slot at position `i` of `token`'s main ‖ extra list, `-1` when the entry is unused
/// (past its cache's length) or at or past `end`.
///
/// # Safety
/// `token < n_tokens`; `end ≤ main.topk + extra.topk`.
#[inline(always)]
unsafe fn index<S: Simt>(p: &SparseMlaV4Params, token: u32, i: u32, end: u32, l: Lens) -> i32 {
    if i >= end {
        return -1;
    }
    let (c, j, len) = if i < p.main.topk {
        (&p.main, i, l.main)
    } else {
        (&p.extra, i - p.main.topk, l.extra)
    };
    if j < len {
        // SAFETY: token < n_tokens, j < topk of that cache: inside its indices.
        unsafe { S::gld(c.indices.add(token as usize * c.topk as usize + j as usize)) }
    } else {
        -1
    }
}

/// A warp's walk over one split of a token's list, 32 positions at a time; every warp
/// of the block walks the same positions and finds the same key blocks.
pub(super) struct Scan {
    base: u32,
    end: u32,
    cur: i32,
    next: i32,
    mask: u32,
    done: bool,
    lens: Lens,
}

/// A key of a block: its slot (`-1`: none) and whether it is in the extra cache.
#[derive(Clone, Copy)]
pub(super) struct Key {
    pub slot: i32,
    pub extra: bool,
}

impl Scan {
    /// Starts at position `begin` and walks to `end` (all lanes of a full warp).
    ///
    /// # Safety
    /// `token < n_tokens`; `begin ≤ end ≤ main.topk + extra.topk`.
    #[inline(always)]
    pub(super) unsafe fn start<S: Simt>(
        p: &SparseMlaV4Params,
        token: u32,
        begin: u32,
        end: u32,
        lens: Lens,
    ) -> Self {
        let lane = S::lane_id();
        // SAFETY: forwarded.
        let (cur, next) = unsafe {
            (
                index::<S>(p, token, begin + lane, end, lens),
                index::<S>(p, token, begin + 32 + lane, end, lens),
            )
        };
        Scan {
            base: begin,
            end,
            cur,
            next,
            mask: S::ballot(FULL, cur >= 0),
            done: begin >= end,
            lens,
        }
    }

    /// The next key block: this lane's key `key` of the block and the block's number of
    /// keys (0 when the list is used up). Warp-uniform; the same result in every warp.
    ///
    /// # Safety
    /// `token` as in [`Scan::start`].
    #[inline(always)]
    pub(super) unsafe fn next_block<S: Simt>(
        &mut self,
        p: &SparseMlaV4Params,
        token: u32,
        key: u32,
    ) -> (Key, u32) {
        let lane = S::lane_id();
        let mut filled = 0;
        let mut mine = Key {
            slot: -1,
            extra: false,
        };
        while filled < BN && !self.done {
            let c = self.mask.count_ones();
            let take = c.min(BN - filled);
            let want = key >= filled && key < filled + take;
            let src = if want {
                nth_set_bit(self.mask, key - filled)
            } else {
                0
            };
            let v = S::shfl_idx(FULL, self.cur as u32, src) as i32;
            if want {
                mine = Key {
                    slot: v,
                    extra: self.base + src >= p.main.topk,
                };
            }
            filled += take;
            if take == c {
                if self.base + 32 >= self.end {
                    self.done = true;
                    self.mask = 0;
                } else {
                    self.base += 32;
                    self.cur = self.next;
                    // SAFETY: token < n_tokens.
                    self.next =
                        unsafe { index::<S>(p, token, self.base + 32 + lane, self.end, self.lens) };
                    self.mask = S::ballot(FULL, self.cur >= 0);
                }
            } else {
                let last = nth_set_bit(self.mask, take - 1);
                self.mask &= !((2u32 << last) - 1);
            }
        }
        (mine, filled)
    }
}

/// 16 bytes at `at` (16-byte aligned when `al16`, else 4).
///
/// # Safety
/// Readable.
#[inline(always)]
pub(super) unsafe fn load16<S: Simt>(at: GlobalPtr<u8>, al16: bool) -> [u32; 4] {
    if al16 {
        // SAFETY: caller's contract.
        unsafe { S::gld(at.cast::<V4>()).0 }
    } else {
        let w = at.cast::<u32>();
        // SAFETY: caller's contract.
        unsafe {
            [
                S::gld(w),
                S::gld(w.add(1)),
                S::gld(w.add(2)),
                S::gld(w.add(3)),
            ]
        }
    }
}

/// Two bf16 (a word) times `s`: exact for a power of two whose products stay in range
/// (the bf16 values of e4m3 codes have at most 4 significant bits).
#[inline(always)]
fn scale_bf16x2(w: u32, s: f32) -> u32 {
    let a = f32::from_bits(w << 16) * s;
    let b = f32::from_bits(w & 0xffff_0000) * s;
    (a.to_bits() >> 16) | (b.to_bits() & 0xffff_0000)
}

/// Gathers this thread's part of key `key` of the block (thread `8·key + sub` owns the
/// 16-byte units `sub + 8i` of the key's row) into shared memory as bf16 chunks; zeros
/// for a missing key. A MODEL1 code unit `u` (16 codes, tile `u / 4`) becomes two chunks,
/// stored lower-first by lanes `sub < 4` and upper-first by the others (the 8 lanes of a
/// key then hit 8 distinct bank groups). With `codes` (the block-scaled path; every key a
/// MODEL1 row) the code units `u < 32` are also kept as they are, at `code_addr(key, u)`
/// (units 28..32, RoPE, in the row's padding), and thread `sub = 0` keeps the key's 8
/// scale bytes at `KS_OFF + 8·key` (zero codes and scale bytes `0x7f` for a missing key).
///
/// # Safety
/// `k.slot` is -1 or a slot of its cache; only this thread touches its chunks between the
/// enclosing barriers; the caches' rows are 4-byte aligned; with `codes`, every cache of
/// the launch is `model1_fp8`.
#[inline(always)]
pub(super) unsafe fn gather_key<S: Simt>(
    p: &SparseMlaV4Params,
    k: Key,
    key: u32,
    sub: u32,
    codes: bool,
) {
    if k.slot < 0 {
        unroll!(8, i, {
            let u = sub + TPK * i as u32;
            // SAFETY: chunk u < 64 of row key < 16.
            unsafe { S::smem_store(chunk_addr(key, u), V4([0; 4])) };
            if codes && i < 4 {
                // SAFETY: code unit u < 32 of key < 16.
                unsafe { S::smem_store(code_addr(key, u), V4([0; 4])) };
            }
        });
        if codes && sub == 0 {
            // SAFETY: the key's scale bytes.
            unsafe { S::smem_store((KS_OFF + 8 * key) as usize, V2([0x7f7f_7f7f; 2])) };
        }
        return;
    }
    let c = if k.extra { &p.extra } else { &p.main };
    let (page, off) = (
        k.slot as u64 / c.page_size as u64,
        k.slot as u64 % c.page_size as u64,
    );
    let page_ptr = c.cache.byte_add((page * c.page_bytes) as usize);
    let row = page_ptr.byte_add((off * c.row_bytes as u64) as usize);
    let al16 = (c.cache.addr() as u64 | c.page_bytes | c.row_bytes as u64) % 16 == 0;
    if c.format == kv_format::MODEL1_FP8 {
        let sc = page_ptr.byte_add((c.scale_section as u64 + 8 * off) as usize);
        // SAFETY: the token's 8 scale bytes (8-byte aligned when the rows are 16-aligned).
        let V2([s_lo, s_hi]) = unsafe {
            if al16 {
                S::gld(sc.cast::<V2>())
            } else {
                V2([S::gld(sc.cast::<u32>()), S::gld(sc.cast::<u32>().add(1))])
            }
        };
        if codes && sub == 0 {
            // SAFETY: the key's scale bytes.
            unsafe { S::smem_store((KS_OFF + 8 * key) as usize, V2([s_lo, s_hi])) };
        }
        let b = (sub >> 2) & 1;
        unroll!(8, i, {
            let u = sub + TPK * i as u32;
            if u < 36 {
                // SAFETY: unit u of the 36 of a MODEL1 row.
                let v = unsafe { load16::<S>(row.byte_add(16 * u as usize), al16) };
                if codes && i < 4 {
                    // Units 28..32 (RoPE) land in the code row's padding.
                    // SAFETY: code unit u < 32 of key < 16.
                    unsafe { S::smem_store(code_addr(key, u), V4(v)) };
                }
                if u < 28 {
                    // Codes of tile u / 4: two chunks of 8 bf16.
                    let tile = u / 4;
                    let byte = if tile < 4 {
                        s_lo >> (8 * tile)
                    } else {
                        s_hi >> (8 * (tile - 4))
                    };
                    let s = ue8m0_to_f32(byte as u8);
                    let conv = |lo: u32, hi: u32| {
                        let w = e4m3x8_to_bf16(lo, hi);
                        V4([
                            scale_bf16x2(w[0], s),
                            scale_bf16x2(w[1], s),
                            scale_bf16x2(w[2], s),
                            scale_bf16x2(w[3], s),
                        ])
                    };
                    let (first, second) = if b == 0 {
                        (conv(v[0], v[1]), conv(v[2], v[3]))
                    } else {
                        (conv(v[2], v[3]), conv(v[0], v[1]))
                    };
                    // SAFETY: chunks 2u, 2u + 1 < 56 of row key.
                    unsafe {
                        S::smem_store(chunk_addr(key, 2 * u + b), first);
                        S::smem_store(chunk_addr(key, 2 * u + 1 - b), second);
                    }
                } else {
                    // Rope: 8 bf16 at unit u (28..36) → chunk 56 + (u − 28) = 28 + u.
                    // SAFETY: chunk 28 + u < 64 of row key.
                    unsafe { S::smem_store(chunk_addr(key, 28 + u), V4(v)) };
                }
            }
        });
    } else {
        unroll!(8, i, {
            let u = sub + TPK * i as u32;
            // SAFETY: unit u of the 64 of a bf16_512 row.
            let v = unsafe { load16::<S>(row.byte_add(16 * u as usize), al16) };
            // SAFETY: chunk u < 64 of row key.
            unsafe { S::smem_store(chunk_addr(key, u), V4(v)) };
        });
    }
}

/// Head `h0 + h`'s query row of token `token` (512 bf16), as bytes.
#[inline(always)]
pub(super) fn q_row(p: &SparseMlaV4Params, token: u32, h0: u32, h: u32) -> GlobalPtr<u8> {
    p.q.add(((token as usize * p.n_heads as usize) + (h0 + h) as usize) * D as usize)
        .cast::<u8>()
}

/// Stages chunks `first..64` of the group's query rows (16 rows × 8 bf16 per chunk, rows
/// past `n_heads` zero) in the Q area as bf16, chunk-swizzled like the key rows: all of
/// them for the bf16 path (`first = 0`), the RoPE dims (`first = 56`) for the
/// block-scaled one.
///
/// # Safety
/// `token < n_tokens`; `first ≤ 64`; no one reads those chunks until the next barrier, nor
/// has since the last one.
#[inline(always)]
pub(super) unsafe fn stage_q<S: Simt>(p: &SparseMlaV4Params, token: u32, h0: u32, first: u32) {
    let chunks = D / 8 - first;
    let aligned = p.q.addr() % 16 == 0;
    let mut i = S::thread_idx();
    while i < V4_HEADS * chunks {
        let (h, c) = (i / chunks, first + i % chunks);
        let v = if h0 + h < p.n_heads {
            let at = q_row(p, token, h0, h).byte_add(16 * c as usize);
            // SAFETY: 8 bf16 of head h0 + h < n_heads of the token.
            unsafe { load16::<S>(at, aligned) }
        } else {
            [0; 4]
        };
        // SAFETY: row h < 16, chunk c < 64: inside the Q area.
        unsafe { S::smem_store(Q_OFF as usize + chunk_addr(h, c), V4(v)) };
        i += THREADS;
    }
}
