//! The `amx` path's matrix core: `C = A · B` on bf16 pairs with Intel AMX tiles
//! (`tdpbf16ps`), for the indexer's score GEMM.
//!
//! # What it computes, and what it does not promise
//!
//! Operands as [`super::dot`] lays them out: `A` row-major bf16 (`[m × 2·k2]`, `lda` in
//! elements), `B` packed as pairs (`[k2][ldb]` of u32: AMX's own `B` layout), `C`
//! row-major f32. Each element is `Σₚ A[i][2p]·B[2p][j] + A[i][2p+1]·B[2p+1][j]` over the
//! pairs in order, 16 pairs per instruction, in f32 with bf16 subnormal inputs read as
//! zero and subnormal results flushed (what the SDM states for `TDPBF16PS`).
//!
//! Unlike every other path, the bits are **not** those of [`super::dot`]'s one arithmetic:
//! the instruction's accumulation inside a tile is not a sequence of f32 FMAs in either
//! pair order, nor one rounding per pair or per instruction (on the Xeon these lines were
//! written on, 30,000 to 51,000 of 51,200 random results differed from each such model in
//! the last bits). Its error is that of an f32 accumulation over `k2` pairs, inside the
//! tolerance table's f32 term, and each element is computed the same way whatever else the
//! call holds (its row of `A`, its column of `B`, the same instructions over the pairs):
//! results are deterministic and batch-invariant on this path, and within tolerance of,
//! but not identical to, the other paths. That is why `amx` is never the default path.
//!
//! # The kernel
//!
//! Tiles of 16 rows × 64 bytes (16 f32 of `C`, 16 pairs of `A` or `B`): blocks of 32 × 32
//! of `C` keep four accumulator tiles, two of `A` and two of `B` (each `A` and `B` tile is
//! used twice per load); the rest of `C` goes tile by tile. A partial tile of `A` (fewer
//! than 16 rows left) is copied into a zero-padded block first, and a partial tile of `C`
//! goes through a full one; `B`'s columns are read in whole tiles of 16 (the callers pad
//! `B` to [`super::dot::padded_cols`]).

use std::cell::Cell;
use std::marker::PhantomData;
use std::sync::OnceLock;

use super::dot::PairDims;

/// Pairs per tile row (one `tdpbf16ps` contracts 16 pairs, 64 bytes of `A`'s row).
pub const TILE_PAIRS: usize = 16;

/// Rows of a tile (and columns of `C` per tile).
const TILE_ROWS: usize = 16;

/// Whether this CPU and OS let the process use AMX-BF16 tiles: the CPU has AMX-TILE and
/// AMX-BF16 with a tile palette of at least 8 tiles of 16 rows × 64 bytes, and the kernel
/// granted this process the tile data state (`arch_prctl(ARCH_REQ_XCOMP_PERM,
/// XFEATURE_XTILEDATA)`: Linux wants it asked for once per process; without it a tile
/// instruction faults). Asked once; the answer is kept.
pub fn available() -> bool {
    static AVAILABLE: OnceLock<bool> = OnceLock::new();
    *AVAILABLE.get_or_init(detect)
}

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn detect() -> bool {
    use std::arch::x86_64::__cpuid_count;
    // SAFETY: `cpuid` exists on every x86_64 CPU; leaves above the maximum return zeros
    // or the highest leaf's values, which the checks below read as "no".
    #[allow(unused_unsafe)]
    let max_leaf = unsafe { __cpuid_count(0, 0) }.eax;
    if max_leaf < 0x1d {
        return false;
    }
    // SAFETY: as above, leaf 7 and 0x1d are below the maximum leaf.
    #[allow(unused_unsafe)]
    let edx7 = unsafe { __cpuid_count(7, 0) }.edx;
    let (amx_bf16, amx_tile) = (edx7 & (1 << 22) != 0, edx7 & (1 << 24) != 0);
    if !(amx_bf16 && amx_tile) {
        return false;
    }
    // SAFETY: as above.
    #[allow(unused_unsafe)]
    let palette1 = unsafe { __cpuid_count(0x1d, 1) };
    let bytes_per_row = palette1.ebx & 0xffff;
    let max_names = palette1.ebx >> 16;
    let max_rows = palette1.ecx & 0xffff;
    if bytes_per_row < 64 || max_names < 8 || max_rows < 16 {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: `arch_prctl(ARCH_REQ_XCOMP_PERM, feature)` takes two integers and touches no
    // memory of ours; it fails (non-zero) where the kernel does not offer the feature.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn detect() -> bool {
    false
}

thread_local! {
    /// Whether a [`TileSession`] holds this thread's tile configuration.
    static SESSION: Cell<bool> = const { Cell::new(false) };
}

/// This thread's tile configuration, loaded once and kept across [`gemm`] calls until the
/// session is dropped (which releases the tiles): a task of many small GEMMs saves the
/// `ldtilecfg` and `tilerelease` of each (about 55 ns a call on the Xeon these lines were
/// written on). Not `Send`: the configuration is the thread's. Between the calls the
/// thread must run none of another AMX user's code (which could load its own).
#[derive(Debug)]
pub struct TileSession {
    _thread: PhantomData<*const ()>,
}

impl TileSession {
    /// Loads the configuration and holds it; `None` where AMX is not available, or while
    /// another session on this thread holds it already (that one keeps it).
    pub fn begin() -> Option<TileSession> {
        if !available() || SESSION.with(Cell::get) {
            return None;
        }
        #[cfg(target_arch = "x86_64")]
        {
            // SAFETY: AMX is available (checked); the config is palette 1, 8 tiles of
            // 16 × 64 bytes.
            unsafe { x86::load_config(&TileConfig::new()) };
            SESSION.with(|s| s.set(true));
            Some(TileSession {
                _thread: PhantomData,
            })
        }
        #[cfg(not(target_arch = "x86_64"))]
        None
    }
}

impl Drop for TileSession {
    fn drop(&mut self) {
        SESSION.with(|s| s.set(false));
        #[cfg(target_arch = "x86_64")]
        // SAFETY: this session configured the tiles on this thread (`begin`).
        unsafe {
            x86::release()
        };
    }
}

/// Whether [`gemm`] takes the shape: whole tiles of pairs (`k2` a positive multiple of
/// [`TILE_PAIRS`]), `A` row-major.
pub fn takes(d: &PairDims) -> bool {
    d.k2 > 0 && d.k2 % TILE_PAIRS == 0
}

/// `C = A · B` (`zero`) or `C += A · B` on AMX tiles (module docs): `A` row-major
/// `[m × lda]` bf16, `B` pairs `[k2][ldb]`, `C` `[m × ldc]` f32.
///
/// # Safety
/// [`available`] returned true; `d.k2` is a positive multiple of [`TILE_PAIRS`]; `d.m` and
/// `d.n` are positive; `a` holds `(m − 1)·lda + 2·k2` elements, `b` holds
/// `(k2 − 1)·ldb + padded_cols(n)` pairs with `ldb ≥ padded_cols(n)`, and `c` holds
/// `(m − 1)·ldc + n` values with `ldc ≥ n`.
#[cfg(target_arch = "x86_64")]
pub unsafe fn gemm(d: PairDims, a: &[u16], b: &[u32], c: &mut [f32], zero: bool) {
    debug_assert!(takes(&d) && d.m > 0 && d.n > 0);
    let kt = d.k2 / TILE_PAIRS;
    let (lda, ldb, ldc) = (2 * d.lda, 4 * d.ldb, 4 * d.ldc);
    // A partial tile's rows of A, zero-padded to 16, and a partial tile of C.
    let mut a_pad: Vec<u16> = Vec::new();
    let mut c_pad = [0f32; TILE_ROWS * TILE_ROWS];
    // The configuration: this thread's session's, or loaded (and released below) here.
    let own = !SESSION.with(Cell::get);
    if own {
        // SAFETY: `available` (the caller's contract): the CPU has AMX and the process may
        // use its tile state; the config is 64 bytes of palette 1, 8 tiles of 16 × 64
        // bytes.
        unsafe { x86::load_config(&TileConfig::new()) };
    }
    let (a, b, c) = (a.as_ptr(), b.as_ptr() as *const u8, c.as_mut_ptr());
    let mut i = 0;
    while i < d.m {
        // A band of two tile rows where 32 rows are left, else one.
        let band = if d.m - i >= 2 * TILE_ROWS { 2 } else { 1 };
        let mut j0 = 0;
        if band == 2 {
            while d.n - j0 >= 2 * TILE_ROWS {
                // SAFETY: rows `i .. i + 32` of A (whole tiles, in place) and of C exist,
                // C's columns `j0 .. j0 + 32` and B's too; the config is loaded.
                unsafe {
                    x86::block_2x2(
                        a.add(i * d.lda) as *const u8,
                        lda,
                        b.add(4 * j0),
                        ldb,
                        c.add(i * d.ldc + j0) as *mut u8,
                        ldc,
                        kt,
                        zero,
                    )
                };
                j0 += 2 * TILE_ROWS;
            }
        }
        // The band's other columns, tile by tile.
        for t in 0..band {
            let r0 = i + t * TILE_ROWS;
            let rows = (d.m - r0).min(TILE_ROWS);
            // The tile's rows of A: in place when whole, else copied into `a_pad`.
            let (a_tile, a_stride) = if rows == TILE_ROWS {
                // SAFETY: row `r0 < m` exists.
                (unsafe { a.add(r0 * d.lda) } as *const u8, lda)
            } else {
                a_pad.resize(TILE_ROWS * 2 * d.k2, 0);
                for (r, dst) in a_pad.chunks_exact_mut(2 * d.k2).enumerate() {
                    if r < rows {
                        // SAFETY: row `r0 + r < m` holds `2·k2` elements (the contract).
                        let src = unsafe {
                            std::slice::from_raw_parts(a.add((r0 + r) * d.lda), 2 * d.k2)
                        };
                        dst.copy_from_slice(src);
                    } else {
                        dst.fill(0);
                    }
                }
                (a_pad.as_ptr() as *const u8, 4 * d.k2)
            };
            let mut j = j0;
            while j < d.n {
                let cols = (d.n - j).min(TILE_ROWS);
                // SAFETY: B's columns `j .. j + 16` exist for every pair (padded to whole
                // tiles).
                let b_j = unsafe { b.add(4 * j) };
                if rows == TILE_ROWS && cols == TILE_ROWS {
                    // SAFETY: a whole tile of C at (r0, j), of A at `a_tile`, B's 16
                    // columns; the config is loaded.
                    unsafe {
                        let c_ij = c.add(r0 * d.ldc + j) as *mut u8;
                        x86::block_1x1(a_tile, a_stride, b_j, ldb, c_ij, ldc, kt, zero)
                    };
                } else {
                    // Row `r` of C's part of the tile: `cols` values from (r0 + r, j).
                    let c_row = |r: usize| {
                        // SAFETY: elements (r0 + r, j .. j + cols) of C exist (the
                        // contract), and no other reference to them is live.
                        unsafe { std::slice::from_raw_parts_mut(c.add((r0 + r) * d.ldc + j), cols) }
                    };
                    if !zero {
                        for r in 0..rows {
                            c_pad[r * TILE_ROWS..][..cols].copy_from_slice(c_row(r));
                        }
                    }
                    let cp = c_pad.as_mut_ptr() as *mut u8;
                    // SAFETY: `c_pad` is a whole tile (64-byte rows); A's tile (in place or
                    // padded) and B's 16 columns exist; the config is loaded.
                    unsafe { x86::block_1x1(a_tile, a_stride, b_j, ldb, cp, 64, kt, zero) };
                    for r in 0..rows {
                        c_row(r).copy_from_slice(&c_pad[r * TILE_ROWS..][..cols]);
                    }
                }
                j += TILE_ROWS;
            }
        }
        i += band * TILE_ROWS;
    }
    if own {
        // SAFETY: the tiles were configured by this thread above.
        unsafe { x86::release() };
    }
}

/// `iters` rounds of four independent `tdpbf16ps` on operands held in tiles (every pair
/// 2^-20 · 2^-20, the accumulators from 1: no overflow, no subnormals); the sum of one
/// accumulator row, which depends on every round. The tile peak's timing kernel
/// ([`super::peak::tile_rounds`]).
///
/// # Safety
/// [`available`] returned true.
#[cfg(target_arch = "x86_64")]
pub unsafe fn peak_rounds(iters: u64) -> f32 {
    #[repr(C, align(64))]
    struct Tile([u32; 256]);
    let ops = Tile([0x3580_3580; 256]);
    let mut acc = Tile([0x3f80_0000; 256]); // 1.0
    let cfg = TileConfig::new();
    // SAFETY: the caller's contract; `ops` and `acc` are whole tiles of 64-byte rows.
    unsafe {
        x86::load_config(&cfg);
        x86::peak(ops.0.as_ptr().cast(), acc.0.as_mut_ptr().cast(), iters);
        x86::release();
    }
    (0..16).map(|j| f32::from_bits(acc.0[j])).sum()
}

/// The tile configuration `ldtilecfg` reads: palette 1, tiles 0–7 all 16 rows × 64 bytes.
#[repr(C, align(64))]
struct TileConfig([u8; 64]);

impl TileConfig {
    fn new() -> Self {
        let mut cfg = [0u8; 64];
        cfg[0] = 1; // palette
        for t in 0..8 {
            cfg[16 + 2 * t] = 64; // bytes per row (u16, little-endian)
            cfg[48 + t] = TILE_ROWS as u8; // rows
        }
        TileConfig(cfg)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::asm;

    use super::TileConfig;

    /// Loads the tile configuration.
    ///
    /// # Safety
    /// AMX is available to this process ([`super::available`]).
    #[inline(always)]
    pub(super) unsafe fn load_config(cfg: &TileConfig) {
        // SAFETY: the caller's contract; `cfg` is 64 readable bytes.
        unsafe { asm!("ldtilecfg [{}]", in(reg) cfg.0.as_ptr(), options(nostack, readonly)) };
    }

    /// Returns the tile state to its initial state (no configuration).
    ///
    /// # Safety
    /// AMX is available to this process.
    #[inline(always)]
    pub(super) unsafe fn release() {
        // SAFETY: the caller's contract.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }

    /// Loads tiles 0–3 from `acc` and 4–7 from `ops`, runs `iters` rounds of
    /// `tdpbf16ps` into 0–3, and stores tile 0 back to `acc`.
    ///
    /// # Safety
    /// The configuration of [`load_config`] is loaded; `ops` and `acc` are 1 KiB tiles of
    /// 64-byte rows.
    #[inline(always)]
    pub(super) unsafe fn peak(ops: *const u8, acc: *mut u8, iters: u64) {
        // SAFETY: the caller's contract.
        unsafe {
            asm!(
                "tileloadd tmm0, [{acc} + {ld}]",
                "tileloadd tmm1, [{acc} + {ld}]",
                "tileloadd tmm2, [{acc} + {ld}]",
                "tileloadd tmm3, [{acc} + {ld}]",
                "tileloadd tmm4, [{ops} + {ld}]",
                "tileloadd tmm5, [{ops} + {ld}]",
                "tileloadd tmm6, [{ops} + {ld}]",
                "tileloadd tmm7, [{ops} + {ld}]",
                "test {n}, {n}",
                "jz 3f",
                "2:",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "dec {n}",
                "jnz 2b",
                "3:",
                "tilestored [{acc} + {ld}], tmm0",
                acc = in(reg) acc,
                ops = in(reg) ops,
                ld = in(reg) 64usize,
                n = inout(reg) iters => _,
                options(nostack),
            );
        }
    }

    /// `C[32 × 32] (+)= A[32 × 32·kt] · B[16·kt pairs × 32]`: C tiles 0–3 (`c`, `c + 64`,
    /// `c + 16·ldc`, `c + 16·ldc + 64`), A tiles 4–5 (`a`, `a + 16·lda`), B tiles 6–7 (`b`,
    /// `b + 64`); strides in bytes.
    ///
    /// # Safety
    /// The configuration of [`load_config`] is loaded; the 32 rows of 64·kt bytes from `a`,
    /// the 16·kt rows of 128 bytes from `b` and the 32 rows of 128 bytes from `c` exist;
    /// `kt ≥ 1`.
    #[allow(clippy::too_many_arguments, reason = "three strided operands")]
    #[inline(always)]
    pub(super) unsafe fn block_2x2(
        a: *const u8,
        lda: usize,
        b: *const u8,
        ldb: usize,
        c: *mut u8,
        ldc: usize,
        kt: usize,
        zero: bool,
    ) {
        let a1 = a.wrapping_add(16 * lda);
        let c1 = c.wrapping_add(16 * ldc);
        // SAFETY: the caller's contract covers every address the tile loads and stores
        // touch; tiles are architectural state no compiled code uses.
        unsafe {
            asm!(
                "test {zero}, {zero}",
                "jz 3f",
                "tilezero tmm0",
                "tilezero tmm1",
                "tilezero tmm2",
                "tilezero tmm3",
                "jmp 4f",
                "3:",
                "tileloadd tmm0, [{c} + {ldc}]",
                "tileloadd tmm1, [{c} + {ldc} + 64]",
                "tileloadd tmm2, [{c1} + {ldc}]",
                "tileloadd tmm3, [{c1} + {ldc} + 64]",
                "4:",
                // The step's four loads first, then its four products: a load placed
                // between the products that read the tiles measured 2.6 times slower.
                "tileloadd tmm4, [{a} + {lda}]",
                "tileloadd tmm5, [{a1} + {lda}]",
                "tileloadd tmm6, [{b} + {ldb}]",
                "tileloadd tmm7, [{b} + {ldb} + 64]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, 64",
                "add {a1}, 64",
                "add {b}, {bstep}",
                "dec {kt}",
                "jnz 4b",
                "tilestored [{c} + {ldc}], tmm0",
                "tilestored [{c} + {ldc} + 64], tmm1",
                "tilestored [{c1} + {ldc}], tmm2",
                "tilestored [{c1} + {ldc} + 64], tmm3",
                zero = in(reg) zero as usize,
                a = inout(reg) a => _,
                a1 = inout(reg) a1 => _,
                lda = in(reg) lda,
                b = inout(reg) b => _,
                ldb = in(reg) ldb,
                bstep = in(reg) 16 * ldb,
                c = in(reg) c,
                c1 = in(reg) c1,
                ldc = in(reg) ldc,
                kt = inout(reg) kt => _,
                options(nostack),
            );
        }
    }

    /// `C[16 × 16] (+)= A[16 × 32·kt] · B[16·kt pairs × 16]` in tile 0 (A in tile 4, B in
    /// tile 6); strides in bytes.
    ///
    /// # Safety
    /// As [`block_2x2`], for 16 rows of `a` and `c` and 64-byte rows of `b` and `c`.
    #[allow(clippy::too_many_arguments, reason = "three strided operands")]
    #[inline(always)]
    pub(super) unsafe fn block_1x1(
        a: *const u8,
        lda: usize,
        b: *const u8,
        ldb: usize,
        c: *mut u8,
        ldc: usize,
        kt: usize,
        zero: bool,
    ) {
        // SAFETY: as in `block_2x2`.
        unsafe {
            asm!(
                "test {zero}, {zero}",
                "jz 3f",
                "tilezero tmm0",
                "jmp 4f",
                "3:",
                "tileloadd tmm0, [{c} + {ldc}]",
                "4:",
                "tileloadd tmm4, [{a} + {lda}]",
                "tileloadd tmm6, [{b} + {ldb}]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "add {a}, 64",
                "add {b}, {bstep}",
                "dec {kt}",
                "jnz 4b",
                "tilestored [{c} + {ldc}], tmm0",
                zero = in(reg) zero as usize,
                a = inout(reg) a => _,
                lda = in(reg) lda,
                b = inout(reg) b => _,
                ldb = in(reg) ldb,
                bstep = in(reg) 16 * ldb,
                c = in(reg) c,
                ldc = in(reg) ldc,
                kt = inout(reg) kt => _,
                options(nostack),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use rand::{Rng, SeedableRng};

    use super::super::dot::{gemm_bf16, gemm_bf16_into, padded_cols, PairDims};
    use super::super::isa::{CpuIsa, Isa};

    /// A bf16 value of either sign over 2^-12 … 2^12 (normal: no flush involved).
    fn value(rng: &mut impl Rng) -> u16 {
        let x = rng.gen_range(1.0f32..2.0) * 2f32.powi(rng.gen_range(-12..12));
        let x = if rng.gen() { -x } else { x };
        half::bf16::from_f32(x).to_bits()
    }

    fn f(bits: u16) -> f64 {
        half::bf16::from_bits(bits).to_f64()
    }

    /// The tile GEMM, through the dot product's entry points on the `amx` path, against an
    /// f64 reference on ragged shapes (partial row and column tiles, double-height bands,
    /// strides with padding, both `C = A·B` over a poisoned C and `C += A·B`): every
    /// element within the f32 accumulation bound `(2·k2 + 1) · 2^-23 · (|c₀| + Σ|a·b|)`.
    /// Then each element's bits again from a call of one row, and of a column block:
    /// batch invariance across the 2 × 2, whole and padded tile kernels.
    #[test]
    fn tile_gemm_matches_f64_and_is_batch_invariant() {
        let Ok(isa) = CpuIsa::new(Isa::Amx) else {
            eprintln!(
                "SKIPPED tile_gemm_matches_f64_and_is_batch_invariant: no AMX-BF16 tiles \
                 granted here (CPU or kernel)"
            );
            return;
        };
        let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(rand::random());
        let mut shapes = vec![
            (1, 1, 16),
            (16, 16, 16),
            (32, 32, 32),
            (64, 64, 64),
            (64, 8, 32),
        ];
        shapes.extend((0..40).map(|_| {
            (
                rng.gen_range(1..=80),
                rng.gen_range(1..=72),
                16 * rng.gen_range(1..=5),
            )
        }));
        for (m, n, k2) in shapes {
            let d = PairDims {
                m,
                n,
                k2,
                lda: 2 * k2 + 2 * rng.gen_range(0..3),
                ldb: padded_cols(n) + 16 * rng.gen_range(0..2),
                ldc: n + rng.gen_range(0..5),
            };
            let a: Vec<u16> = (0..(m - 1) * d.lda + 2 * k2)
                .map(|_| value(&mut rng))
                .collect();
            let b: Vec<u32> = (0..(k2 - 1) * d.ldb + padded_cols(n))
                .map(|_| value(&mut rng) as u32 | (value(&mut rng) as u32) << 16)
                .collect();
            let c_len = (m - 1) * d.ldc + n;
            let accumulate = rng.gen::<bool>();
            let c0: Vec<f32> = (0..c_len)
                .map(|_| {
                    if accumulate {
                        f(value(&mut rng)) as f32
                    } else {
                        f32::NAN
                    }
                })
                .collect();
            let mut c = c0.clone();
            if accumulate {
                gemm_bf16(isa, d, &a, &b, &mut c);
            } else {
                gemm_bf16_into(isa, d, &a, &b, &mut c);
            }
            for i in 0..m {
                for j in 0..n {
                    let init = if accumulate {
                        c0[i * d.ldc + j] as f64
                    } else {
                        0.0
                    };
                    let (mut want, mut mag) = (init, init.abs());
                    for p in 0..k2 {
                        let w = b[p * d.ldb + j];
                        for (e, bv) in [(0, w as u16), (1, (w >> 16) as u16)] {
                            let t = f(a[i * d.lda + 2 * p + e]) * f(bv);
                            want += t;
                            mag += t.abs();
                        }
                    }
                    let got = c[i * d.ldc + j];
                    let bound = (2 * k2 + 1) as f64 * 2f64.powi(-23) * mag;
                    assert!(
                        (got as f64 - want).abs() <= bound,
                        "{m}×{n}×{k2} ({}) C[{i}][{j}] = {got}, want {want} ± {bound}",
                        if accumulate { "+=" } else { "=" }
                    );
                }
            }
            // One row alone (the padded single-tile kernel), and the columns from a random
            // block on (fewer columns: other tiles, other kernels).
            let i = rng.gen_range(0..m);
            let row = PairDims { m: 1, ..d };
            let mut one = c0[i * d.ldc..i * d.ldc + n].to_vec();
            let a_i = &a[i * d.lda..];
            if accumulate {
                gemm_bf16(isa, row, a_i, &b, &mut one);
            } else {
                gemm_bf16_into(isa, row, a_i, &b, &mut one);
            }
            for j in 0..n {
                assert_eq!(
                    one[j].to_bits(),
                    c[i * d.ldc + j].to_bits(),
                    "row {i} alone, col {j}"
                );
            }
            // The same call inside a session (the configuration held, not reloaded): the
            // same bits; a second session on the thread is refused while one holds it.
            {
                let session = super::TileSession::begin();
                assert!(session.is_some());
                assert!(super::TileSession::begin().is_none());
                let mut again = c0.clone();
                if accumulate {
                    gemm_bf16(isa, d, &a, &b, &mut again);
                } else {
                    gemm_bf16_into(isa, d, &a, &b, &mut again);
                }
                assert!(
                    again
                        .iter()
                        .zip(&c)
                        .all(|(x, y)| x.to_bits() == y.to_bits()),
                    "{m}×{n}×{k2} inside a session"
                );
            }
            let j0 = 16 * rng.gen_range(0..padded_cols(n) / 16);
            let cols = PairDims { n: n - j0, ..d };
            let mut part = c0.clone();
            if accumulate {
                gemm_bf16(isa, cols, &a, &b[j0..], &mut part[j0..]);
            } else {
                gemm_bf16_into(isa, cols, &a, &b[j0..], &mut part[j0..]);
            }
            for i in 0..m {
                for j in j0..n {
                    let (g, w) = (part[i * d.ldc + j], c[i * d.ldc + j]);
                    assert_eq!(g.to_bits(), w.to_bits(), "columns from {j0}: C[{i}][{j}]");
                }
            }
        }
    }

    /// The path exists exactly where the CPU and the kernel allow the tiles, and never
    /// becomes the default.
    #[test]
    fn amx_is_offered_only_where_granted_and_never_by_default() {
        assert_eq!(
            Isa::Amx.supported(),
            super::available() && Isa::Avx512.supported()
        );
        assert_ne!(CpuIsa::detected().isa(), Isa::Amx);
        assert_ne!(CpuIsa::widest().isa(), Isa::Amx);
        assert_eq!(
            CpuIsa::available().iter().any(|i| i.isa() == Isa::Amx),
            Isa::Amx.supported()
        );
    }
}
