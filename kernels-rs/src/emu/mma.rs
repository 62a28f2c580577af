//! Tensor-core `mma.sync` arithmetic on a whole warp's fragments.
//!
//! Fragment layouts follow the PTX ISA ("Matrix Fragments for mma.m16n8k16" with
//! `.bf16`, and "for mma.m16n8k32" with `.e4m3`), with `g = lane / 4`, `t = lane % 4`:
//!
//! | operand | register | bf16 `m16n8k16` | e4m3 `m16n8k32` |
//! |---|---|---|---|
//! | A (row-major) | `a[0]` | row g, k 2t..=2t+1 | row g, k 4t..=4t+3 |
//! | | `a[1]` | row g+8, k 2t..=2t+1 | row g+8, k 4t..=4t+3 |
//! | | `a[2]` | row g, k 2t+8..=2t+9 | row g, k 16+4t..=16+4t+3 |
//! | | `a[3]` | row g+8, k 2t+8..=2t+9 | row g+8, k 16+4t..=16+4t+3 |
//! | B (column-major) | `b[0]` | k 2t..=2t+1, col g | k 4t..=4t+3, col g |
//! | | `b[1]` | k 2t+8..=2t+9, col g | k 16+4t..=16+4t+3, col g |
//! | C, D (f32) | `c[0]`, `c[1]` | row g, cols 2t, 2t+1 | same |
//! | | `c[2]`, `c[3]` | row g+8, cols 2t, 2t+1 | same |
//!
//! Within a 32-bit register the lowest-addressed element (the lower k) sits in the low
//! bits: half-word 0 for bf16, byte 0 for e4m3.
//!
//! The block-scaled `kind::mxf8f6f4 … scale_vec::1X` form (sm_120a) takes the e4m3
//! fragments above plus one ue8m0 scale per A row and per B column, in byte 0 of a scale
//! register (byte and thread selectors 0): lane `4g` supplies A row `g` and B column `g`,
//! lane `4g + 1` A row `g + 8`; the scale registers of lanes `4g + 2`, `4g + 3` (and lane
//! `4g + 1`'s B scale) are ignored. This is the map of CUTLASS's SM120 block-scaled MMA
//! traits (`SM120_16x8x32_TN_VS`: SFA `((2,2,8),32):((8,0,1),16)`, SFB
//! `((4,8),32):((0,1),8)`), which a public probe on sm_121a hardware confirms.
//!
//! Arithmetic: `D[i][j] = C[i][j] + Σ_k A[i][k]·B[k][j]`, accumulated in f64 starting from
//! C and adding the products in increasing k, then rounded once to f32 (round to nearest
//! even). Every product of two bf16 or two e4m3 values is exact in f64. Real tensor cores
//! accumulate differently (truncating intermediate alignment, no f64), so results agree
//! with hardware only to within a small tolerance, not bit for bit.

use crate::mx::ue8m0_to_f32;

/// One lane's operands of an `mma.sync`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct MmaFragments {
    /// A fragment registers.
    pub a: [u32; 4],
    /// B fragment registers.
    pub b: [u32; 2],
    /// C fragment (accumulator in).
    pub c: [f32; 4],
    /// Scale registers of the block-scaled form (`sfa`, `sfb`); unused otherwise.
    pub scale: [u32; 2],
}

/// M dimension of both shapes.
const M: usize = 16;
/// N dimension of both shapes.
const N: usize = 8;

/// Decodes a bf16 bit pattern exactly.
pub(crate) fn bf16_to_f64(bits: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(bits) << 16))
}

/// Decodes an e4m3 (`e4m3fn`: no infinities) bit pattern exactly: sign, 4 exponent bits
/// with bias 7, 3 mantissa bits; exponent 0 is subnormal (`m · 2^-9`); `0x7f`/`0xff` are
/// NaN.
pub(crate) fn e4m3_to_f64(bits: u8) -> f64 {
    let sign = if bits & 0x80 != 0 { -1.0 } else { 1.0 };
    let exp = i32::from((bits >> 3) & 0xf);
    let mant = f64::from(bits & 0x7);
    if exp == 0xf && bits & 0x7 == 0x7 {
        return f64::NAN;
    }
    if exp == 0 {
        sign * mant * 2f64.powi(-9)
    } else {
        sign * (1.0 + mant / 8.0) * 2f64.powi(exp - 7)
    }
}

/// `(row, k)` of A held by element `e` (0..per) of register `reg` of lane
/// `lane`, for an MMA with `per` elements per register (2 for bf16, 4 for e4m3) and
/// K = `8 * per`.
fn a_coord(lane: usize, reg: usize, e: usize, per: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let row = g + if reg % 2 == 1 { 8 } else { 0 };
    let k = per * t + e + if reg >= 2 { 4 * per } else { 0 };
    (row, k)
}

/// `(k, col)` of B held by element `e` of register `reg` of lane `lane` (see
/// [`a_coord`]).
fn b_coord(lane: usize, reg: usize, e: usize, per: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    let k = per * t + e + if reg == 1 { 4 * per } else { 0 };
    (k, g)
}

/// `(row, col)` of C/D element `i` of lane `lane`.
fn c_coord(lane: usize, i: usize) -> (usize, usize) {
    let (g, t) = (lane / 4, lane % 4);
    (g + if i >= 2 { 8 } else { 0 }, 2 * t + i % 2)
}

/// The lane whose scale register gives A row `row` of the block-scaled form.
fn sfa_lane(row: usize) -> usize {
    4 * (row % 8) + row / 8
}

/// The lane whose scale register gives B column `col` of the block-scaled form.
fn sfb_lane(col: usize) -> usize {
    4 * col
}

/// Runs one warp-wide MMA with `per` elements per 32-bit register (2 for bf16, 4 for
/// e4m3; K = 8 · per), each decoded by `decode` from its `32 / per` bits; with
/// `block_scaled`, A row `r` is multiplied by its ue8m0 scale (byte 0 of lane
/// [`sfa_lane`]`(r)`'s `scale[0]`) and B column `c` by its own (lane [`sfb_lane`]`(c)`'s
/// `scale[1]`), exactly.
fn mma(
    lanes: &[MmaFragments; 32],
    per: usize,
    decode: impl Fn(u32) -> f64,
    block_scaled: bool,
) -> [[f32; 4]; 32] {
    let k_dim = 8 * per;
    let bits = 32 / per;
    let elem_mask = (1u64 << bits) - 1;
    let elem = |reg: u32, e: usize| decode(((u64::from(reg) >> (bits * e)) & elem_mask) as u32);
    let mut a = vec![[0f64; 32]; M];
    let mut b = vec![[0f64; N]; 32];
    let mut c = [[0f64; N]; M];
    for (lane, frag) in lanes.iter().enumerate() {
        for (reg, &r) in frag.a.iter().enumerate() {
            for e in 0..per {
                let (row, k) = a_coord(lane, reg, e, per);
                a[row][k] = elem(r, e);
            }
        }
        for (reg, &r) in frag.b.iter().enumerate() {
            for e in 0..per {
                let (k, col) = b_coord(lane, reg, e, per);
                b[k][col] = elem(r, e);
            }
        }
        for (i, &v) in frag.c.iter().enumerate() {
            let (row, col) = c_coord(lane, i);
            c[row][col] = f64::from(v);
        }
    }
    if block_scaled {
        for (row, a) in a.iter_mut().enumerate() {
            let s = f64::from(ue8m0_to_f32(lanes[sfa_lane(row)].scale[0] as u8));
            a.iter_mut().for_each(|x| *x *= s);
        }
        for col in 0..N {
            let s = f64::from(ue8m0_to_f32(lanes[sfb_lane(col)].scale[1] as u8));
            b.iter_mut().for_each(|r| r[col] *= s);
        }
    }
    let mut out = [[0f32; 4]; 32];
    for (lane, d) in out.iter_mut().enumerate() {
        for (i, d) in d.iter_mut().enumerate() {
            let (row, col) = c_coord(lane, i);
            let mut acc = c[row][col];
            for k in 0..k_dim {
                acc += a[row][k] * b[k][col];
            }
            *d = acc as f32;
        }
    }
    out
}

/// `mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32` over the 32 lanes' fragments;
/// returns each lane's D fragment.
pub(crate) fn mma_bf16_m16n8k16(lanes: &[MmaFragments; 32]) -> [[f32; 4]; 32] {
    mma(lanes, 2, |bits| bf16_to_f64(bits as u16), false)
}

/// `mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32` over the 32 lanes' fragments;
/// returns each lane's D fragment.
pub(crate) fn mma_e4m3_m16n8k32(lanes: &[MmaFragments; 32]) -> [[f32; 4]; 32] {
    mma(lanes, 4, |bits| e4m3_to_f64(bits as u8), false)
}

/// `mma.sync.aligned.m16n8k32.row.col.kind::mxf8f6f4.block_scale.scale_vec::1X.f32.e4m3.
/// e4m3.f32.ue8m0` (scale selectors 0) over the 32 lanes' fragments and scale registers;
/// returns each lane's D fragment.
pub(crate) fn mma_mxf8_e4m3_m16n8k32(lanes: &[MmaFragments; 32]) -> [[f32; 4]; 32] {
    mma(lanes, 4, |bits| e4m3_to_f64(bits as u8), true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_decode_known_values() {
        assert_eq!(e4m3_to_f64(0x00), 0.0);
        assert_eq!(e4m3_to_f64(0x38), 1.0);
        assert_eq!(e4m3_to_f64(0x7e), 448.0);
        assert_eq!(e4m3_to_f64(0xfe), -448.0);
        assert_eq!(e4m3_to_f64(0x01), 2f64.powi(-9));
        assert_eq!(e4m3_to_f64(0x08), 2f64.powi(-6));
        assert!(e4m3_to_f64(0x7f).is_nan());
        assert!(e4m3_to_f64(0xff).is_nan());
    }

    #[test]
    fn coordinates_cover_each_element_once() {
        for per in [2usize, 4] {
            let mut a = vec![0u32; 16 * 8 * per];
            let mut b = vec![0u32; 8 * per * 8];
            let mut c = [0u32; 128];
            for lane in 0..32 {
                for e in 0..per {
                    for reg in 0..4 {
                        let (row, k) = a_coord(lane, reg, e, per);
                        a[row * 8 * per + k] += 1;
                    }
                    for reg in 0..2 {
                        let (k, col) = b_coord(lane, reg, e, per);
                        b[k * 8 + col] += 1;
                    }
                }
                for i in 0..4 {
                    let (row, col) = c_coord(lane, i);
                    c[row * 8 + col] += 1;
                }
            }
            assert!(a.iter().chain(&b).chain(&c).all(|&n| n == 1));
        }
    }

    /// Each A row and B column takes its scale from exactly one lane, and only lanes
    /// `4g` and `4g + 1` supply any (the map of the module docs).
    #[test]
    fn block_scale_lanes() {
        let rows: Vec<usize> = (0..M).map(sfa_lane).collect();
        let cols: Vec<usize> = (0..N).map(sfb_lane).collect();
        for lane in 0..32 {
            let (g, t) = (lane / 4, lane % 4);
            let want_rows: Vec<usize> = match t {
                0 => vec![g],
                1 => vec![g + 8],
                _ => vec![],
            };
            let got: Vec<usize> = (0..M).filter(|&r| rows[r] == lane).collect();
            assert_eq!(got, want_rows, "lane {lane}");
            let got: Vec<usize> = (0..N).filter(|&c| cols[c] == lane).collect();
            assert_eq!(got, if t == 0 { vec![g] } else { vec![] }, "lane {lane}");
        }
    }
}
