//! Key blocks of `sparse_mla`: finding a token's valid slots (per warp, with ballots)
//! and moving the keys from the paged KV cache into shared memory as bf16.

use super::{Geometry, Role, BN, MAXIT};
use crate::fp8::e4m3x8_to_bf16;
use crate::global::{GlobalPtr, V4};
use crate::kernels::FULL;
use crate::params::SparseMlaParams;
use crate::simt::Simt;

/// A warp's walk over one split of a token's indices (see `sparse_mla_split`), 32 at a
/// time. Every warp of the block walks the same indices and therefore finds the same key
/// blocks.
pub(super) struct Scan {
    /// Position of the current chunk in the token's indices.
    base: u32,
    /// This lane's index of the current chunk (`-1` past `topk`).
    cur: i32,
    /// This lane's index of the next chunk (prefetched).
    next: i32,
    /// Valid, not yet used positions of the current chunk.
    mask: u32,
    /// All indices used.
    done: bool,
}

/// The end (exclusive) of the split holding index `i` (`i < topk`; a split starts at a
/// multiple of `p.split`): computed where needed rather than kept in a register.
#[inline(always)]
fn split_end(p: &SparseMlaParams, i: u32) -> u32 {
    let split = p.split.max(1);
    (i - i % split + split).min(p.topk)
}

/// The token's index `i`, or -1 at or past `end` (≤ `topk`).
///
/// # Safety
/// `token < n_tokens`, `end ≤ topk`.
#[inline(always)]
unsafe fn index<S: Simt>(p: &SparseMlaParams, token: u32, i: u32, end: u32) -> i32 {
    if i < end {
        // SAFETY: token < n_tokens and i < topk: inside `indices`.
        unsafe { S::gld(p.indices.add(token as usize * p.topk as usize + i as usize)) }
    } else {
        -1
    }
}

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

impl Scan {
    /// Starts at index `begin` (the first of a split) of the token's indices, walking to
    /// the split's end (all lanes of a full warp).
    ///
    /// # Safety
    /// `token < n_tokens`; `begin` is 0 or a split's first index (`begin < topk`).
    #[inline(always)]
    pub(super) unsafe fn start<S: Simt>(
        p: &SparseMlaParams,
        token: u32,
        lane: u32,
        begin: u32,
    ) -> Self {
        let end = if p.topk == 0 { 0 } else { split_end(p, begin) };
        // SAFETY: token < n_tokens, end ≤ topk.
        let (cur, next) = unsafe {
            (
                index::<S>(p, token, begin + lane, end),
                index::<S>(p, token, begin + 32 + lane, end),
            )
        };
        Scan {
            base: begin,
            cur,
            next,
            mask: S::ballot(FULL, cur >= 0),
            done: false,
        }
    }

    /// The next key block: this lane's slot for block key `key` (`-1` past the block's
    /// end) and the block's number of keys (0 when the indices are used up). Warp-uniform
    /// control flow; the same result in every warp.
    ///
    /// # Safety
    /// `token` as in [`Scan::start`].
    #[inline(always)]
    pub(super) unsafe fn next_block<S: Simt>(
        &mut self,
        p: &SparseMlaParams,
        token: u32,
        key: u32,
        lane: u32,
    ) -> (i32, u32) {
        let mut filled = 0;
        let mut slot = -1;
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
                slot = v;
            }
            filled += take;
            if take == c {
                let end = split_end(p, self.base);
                if self.base + 32 >= end {
                    self.done = true;
                    self.mask = 0;
                } else {
                    self.base += 32;
                    self.cur = self.next;
                    // SAFETY: token < n_tokens.
                    self.next = unsafe { index::<S>(p, token, self.base + 32 + lane, end) };
                    self.mask = S::ballot(FULL, self.cur >= 0);
                }
            } else {
                // 0 < take < c: drop the lowest `take` set bits (the highest one dropped
                // is below bit 31).
                let last = nth_set_bit(self.mask, take - 1);
                self.mask &= !((2u32 << last) - 1);
            }
        }
        (slot, filled)
    }
}

/// Global loads of one thread for one key block: source unit `sub + 8i - shift`
/// (`i < MAXIT`) of its key in `v[i]` (see [`Geometry::units`]; the fp8 tile scales are
/// units too). `shift` (0 or 1) aligns the 8 units a key's lanes load together to 32-byte
/// sectors when the token row starts 16 bytes past one (fp8_ds_mla rows are 656 bytes):
/// then every load instruction but the token's first covers whole sectors.
#[derive(Default)]
pub(super) struct Prefetch {
    v: [[u32; 4]; MAXIT],
    shift: u32,
}

/// Unit `8i + sub - shift`, if it exists.
#[inline(always)]
fn unit_of(g: &Geometry, sub: u32, i: usize, shift: u32) -> Option<u32> {
    let k = sub + 8 * i as u32;
    (k >= shift && k - shift < g.units).then(|| k - shift)
}

/// Whether every token row (and `extra`) is aligned to `align` bytes.
#[inline(always)]
fn aligned(p: &SparseMlaParams, align: u64, extra: u32) -> bool {
    (p.cache.addr() as u64 | p.page_bytes | p.token_bytes as u64 | extra as u64) % align == 0
}

/// Whether the prefetch can gather `p`'s keys: token rows, rope and scales 16-byte
/// aligned (DeepSeek-V3.2 layouts in allocator-aligned buffers), so that it has one load
/// form only (`ld.v4`; with a fallback form beside it the compiler merges the two into
/// narrower loads), and the scale units inside the token row. Other layouts are gathered
/// by [`store_rest`] alone.
#[inline(always)]
pub(super) fn prefetchable(p: &SparseMlaParams, g: &Geometry) -> bool {
    aligned(p, 16, p.rope_offset | p.scales_offset)
        && p.scales_offset + 16 * g.scale_units <= p.token_bytes
}

/// The key row of `slot` (null for `slot < 0`).
#[inline(always)]
fn token_row(p: &SparseMlaParams, slot: i32) -> GlobalPtr<u8> {
    if slot < 0 {
        return GlobalPtr::null();
    }
    let (page, off) = (
        slot as u64 / p.page_size as u64,
        slot as u64 % p.page_size as u64,
    );
    p.cache
        .byte_add((page * p.page_bytes + off * p.token_bytes as u64) as usize)
}

/// Byte offset of source unit `u` inside a token row.
#[inline(always)]
fn unit_offset(p: &SparseMlaParams, g: &Geometry, u: u32) -> usize {
    let rope = g.lat_units + g.scale_units;
    if u < g.lat_units {
        16 * u as usize
    } else if u < rope {
        (p.scales_offset + 16 * (u - g.lat_units)) as usize
    } else {
        (p.rope_offset + 16 * (u - rope)) as usize
    }
}

/// Stores source unit `u` (16 bytes `v`) of key row `key`: a bf16 chunk, two chunks for
/// 16 e4m3 codes, or up to 4 tile scales into the scale table.
///
/// The two chunks of an e4m3 unit are stored lower-first when `u % 8 < 4` and
/// upper-first otherwise, so that each store instruction of the 8 lanes of a key (8
/// consecutive units) hits 8 distinct 16-byte bank groups.
///
/// # Safety
/// `key < 32`, `u < units`; only this thread touches the chunks and scales between the
/// enclosing barriers.
#[inline(always)]
unsafe fn store_unit<S: Simt>(g: &Geometry, key: u32, u: u32, v: [u32; 4]) {
    let rope = g.lat_units + g.scale_units;
    if g.fp8 && u < g.lat_units {
        let b = (u >> 2) & 1;
        // The codes of chunk 2u + b, then of the other one (selected before converting,
        // so that one chunk's bf16 words are live at a time).
        let (lo, hi) = if b == 0 { (v[0], v[1]) } else { (v[2], v[3]) };
        // SAFETY: chunks 2u, 2u + 1 < nope/8 of the key row (caller's contract).
        unsafe { S::smem_store(g.chunk_addr(key, 2 * u + b), V4(e4m3x8_to_bf16(lo, hi))) };
        let (lo, hi) = if b == 0 { (v[2], v[3]) } else { (v[0], v[1]) };
        // SAFETY: as above.
        unsafe { S::smem_store(g.chunk_addr(key, 2 * u + 1 - b), V4(e4m3x8_to_bf16(lo, hi))) };
    } else if u >= g.lat_units && u < rope {
        let first = 4 * (u - g.lat_units);
        unroll!(4, i, {
            let tile = first + i as u32;
            if tile < g.tiles {
                // SAFETY: tile < tiles, key < 32: inside the scale table; this key's entry.
                unsafe {
                    S::smem_store(
                        (g.scale_off + 4 * (tile * BN + key)) as usize,
                        f32::from_bits(v[i]),
                    )
                };
            }
        });
    } else {
        let c = if u < g.lat_units {
            u
        } else {
            g.nope_chunks + (u - rope)
        };
        // SAFETY: c < chunks: inside the key row (caller's contract).
        unsafe { S::smem_store(g.chunk_addr(key, c), V4(v)) };
    }
}

/// Issues the prefetch's global loads for `slot`'s key (zeros for `slot < 0`): one
/// 16-byte load per unit, from a selected address (a single load form, so the compiler
/// keeps it a `ld.v4`).
///
/// # Safety
/// `slot` is -1 or a slot of the cache described by `p`; [`prefetchable`]`(p)`.
#[inline(always)]
pub(super) unsafe fn issue<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    slot: i32,
) -> Prefetch {
    let mut pf = Prefetch::default();
    if slot < 0 {
        return pf;
    }
    let tok = token_row(p, slot);
    if g.shiftable {
        pf.shift = ((tok.addr() / 16) & 1) as u32;
    }
    unroll!(9, i, {
        if let Some(u) = unit_of(g, r.sub, i, pf.shift) {
            let at = tok.byte_add(unit_offset(p, g, u)).cast::<V4>();
            // SAFETY: 16 bytes of the token row (u < units; the scale units end inside
            // it), 16-byte aligned (prefetchable layout).
            pf.v[i] = unsafe { S::gld(at) }.0;
        }
    });
    pf
}

/// Stores what [`issue`] loaded as bf16 key-row chunks and tile scales.
///
/// # Safety
/// Only this thread touches its key's chunks and scales between the enclosing barriers;
/// the launch provides [`Geometry::smem`] bytes.
#[inline(always)]
pub(super) unsafe fn store<S: Simt>(g: &Geometry, r: &Role, pf: &Prefetch) {
    unroll!(9, i, {
        if let Some(u) = unit_of(g, r.sub, i, pf.shift) {
            // SAFETY: key < 32, u < units (the caller's exclusivity).
            unsafe { store_unit::<S>(g, r.key, u, pf.v[i]) };
        }
    });
}

/// Gathers (synchronously, one unit at a time) `slot`'s source units `sub + 8k` from
/// `k = from` on (zeros for `slot < 0`): `from = MAXIT` completes the prefetch for rows
/// wider than it, `from = 0` gathers a layout that is not [`prefetchable`], at any
/// alignment (a scale unit reads only the scales that exist).
///
/// # Safety
/// As [`issue`] (any alignment) and [`store`].
#[inline(always)]
pub(super) unsafe fn store_rest<S: Simt>(
    p: &SparseMlaParams,
    g: &Geometry,
    r: &Role,
    slot: i32,
    from: u32,
) {
    let tok = token_row(p, slot);
    let al16 = aligned(p, 16, p.rope_offset);
    let scales = g.lat_units..g.lat_units + g.scale_units;
    let mut u = r.sub + 8 * from;
    while u < g.units {
        let at = tok.byte_add(unit_offset(p, g, u));
        let v = if slot < 0 {
            [0; 4]
        } else if scales.contains(&u) {
            let first = 4 * (u - g.lat_units);
            let mut v = [0u32; 4];
            unroll!(4, i, {
                if first + (i as u32) < g.tiles {
                    // SAFETY: the f32 scale of tile first + i < tiles of the token.
                    v[i] = unsafe { word::<S>(at.add(4 * i)) };
                }
            });
            v
        } else {
            // SAFETY: 16 bytes of the token row (u < units).
            unsafe { load16::<S>(at, al16) }
        };
        // SAFETY: key < 32, u < units (the caller's exclusivity).
        unsafe { store_unit::<S>(g, r.key, u, v) };
        u += 8;
    }
}

/// 16 bytes of global memory at any alignment (16-byte aligned when `al16`).
///
/// # Safety
/// Readable.
#[inline(always)]
pub(super) unsafe fn load16<S: Simt>(at: GlobalPtr<u8>, al16: bool) -> [u32; 4] {
    if al16 {
        // SAFETY: caller's contract.
        unsafe { S::gld(at.cast::<V4>()).0 }
    } else {
        // SAFETY: caller's contract.
        unsafe {
            [
                word::<S>(at),
                word::<S>(at.add(4)),
                word::<S>(at.add(8)),
                word::<S>(at.add(12)),
            ]
        }
    }
}

/// A little-endian u32 from 4 bytes at any alignment (byte loads: no local copy).
///
/// # Safety
/// 4 readable bytes.
#[inline(always)]
unsafe fn word<S: Simt>(at: GlobalPtr<u8>) -> u32 {
    // SAFETY: caller's contract.
    unsafe {
        S::gld(at) as u32
            | (S::gld(at.add(1)) as u32) << 8
            | (S::gld(at.add(2)) as u32) << 16
            | (S::gld(at.add(3)) as u32) << 24
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nth_set_bit_matches_a_scan() {
        for m in [
            1u32,
            0x8000_0000,
            0xffff_ffff,
            0x1234_5678,
            0xa5a5_0f0f,
            0x8000_0001,
        ] {
            let mut n = 0;
            for pos in 0..32 {
                if m >> pos & 1 == 1 {
                    assert_eq!(nth_set_bit(m, n), pos);
                    n += 1;
                }
            }
        }
    }

    #[test]
    fn swizzle_is_conflict_free() {
        use super::super::swz;
        // Score loads: rows 4p..4p+3, chunks 2ks + {0, 1}: 8 distinct bank groups.
        for p in 0..2 {
            let mut seen = [false; 8];
            for i in 0..4 {
                for h in 0..2 {
                    let c = ((h ^ swz(4 * p + i)) & 7) as usize;
                    assert!(!seen[c]);
                    seen[c] = true;
                }
            }
        }
        // V loads: rows 2t + e (t = 0..3), chunks {4p + h, 4p + 2 + h} (lanes g = 2p, 2p+1).
        for e in 0..2 {
            for p in 0..2 {
                for h in 0..2 {
                    let mut seen = [false; 8];
                    for t in 0..4 {
                        for c in [4 * p + h, 4 * p + 2 + h] {
                            let b = ((c ^ swz(2 * t + e)) & 7) as usize;
                            assert!(!seen[b]);
                            seen[b] = true;
                        }
                    }
                }
            }
        }
    }
}
