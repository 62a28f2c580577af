//! fp8 e4m3fn codec and quantization scales, shared by the kernels and the host (which
//! re-exports them from `sparsekit_host::dtype`). Pure integer/f32 arithmetic, `no_std`.
//!
//! - [`e4m3_encode`]: round to nearest, ties to even, **saturating** to ±448 (±inf
//!   included), NaN kept (code `0x7f | sign`) — equal to
//!   `np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)`.
//! - Index-K scale: `max(amax, 1e-4) / 448` (f32), optionally rounded up to a power of two.
//! - fp8_ds_mla tile scale: `2^ceil(log2(max(amax / 448, 1e-4)))`.

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Floor applied to `amax` (index-K) or `amax / 448` (KV tiles) before computing a scale.
pub const SCALE_FLOOR: f32 = 1e-4;

/// Encodes an f32 as fp8 e4m3fn (see the module docs). Branch-free (selects only), so it
/// vectorises on the CPU and does not diverge on the GPU:
/// - normal range `[2^-6, 448)`: round the f32 bits at bit 20 to nearest even (the carry
///   runs into the exponent) and rebias (`(e - 120) << 3`);
/// - subnormal range: `a · 512` is exact and below 8; adding 2^23 rounds it to the
///   nearest integer (ties to even) in the low mantissa bits, read back as
///   `bits(m + 2^23) - bits(2^23)` (no float-to-int conversion);
/// - `a >= 448` (inf included) saturates to 448, NaN keeps its sign.
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = (bits >> 24) & 0x80;
    let abits = bits & 0x7fff_ffff;
    let a = f32::from_bits(abits);
    let normal = (abits.wrapping_add(0x7_ffff + ((abits >> 20) & 1)) >> 20).wrapping_sub(120 << 3);
    const TWO_23: f32 = 8_388_608.0;
    let sub = (a * 512.0 + TWO_23)
        .to_bits()
        .wrapping_sub(TWO_23.to_bits());
    let mag = if a < 1.0 / 64.0 { sub } else { normal };
    let mag = if a >= E4M3_MAX { 0x7e } else { mag };
    let mag = if a.is_nan() { 0x7f } else { mag };
    (sign | mag) as u8
}

/// Decodes an fp8 e4m3fn code to f32 (exact).
#[inline]
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

/// All 256 e4m3fn codes decoded; index with the code.
pub static E4M3_TABLE: [f32; 256] = build_table();

const fn build_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = decode_bits(c as u8);
        c += 1;
    }
    t
}

/// Decodes from the bit fields (used to build the table; also usable on the device).
#[inline]
pub const fn decode_bits(code: u8) -> f32 {
    let e = ((code >> 3) & 0xf) as u32;
    let m = (code & 7) as u32;
    let sign = ((code as u32) & 0x80) << 24;
    let mag = if e == 0xf && m == 7 {
        0x7fc0_0000
    } else if e == 0 {
        if m == 0 {
            0
        } else {
            // m * 2^-9 with m = 1.f * 2^p, p = floor(log2 m).
            let p = 31 - m.leading_zeros();
            ((p + 127 - 9) << 23) | ((m << (23 - p)) & 0x7f_ffff)
        }
    } else {
        ((e + 120) << 23) | (m << 20)
    };
    f32::from_bits(sign | mag)
}

/// Decodes an e4m3fn code with arithmetic only (no table: vectorises on the CPU and
/// needs no memory on the GPU). Equal to [`e4m3_decode`] for every code.
#[inline(always)]
pub fn e4m3_to_f32(code: u8) -> f32 {
    let c = code as u32;
    let sign = (c & 0x80) << 24;
    let x = c & 0x7f;
    // Normal: exponent field e (bias 7) → f32 field e + 120, mantissa bits shifted up.
    let normal = f32::from_bits((x << 20) + (120 << 23));
    // Subnormal (x < 8): m · 2^-9.
    let sub = x as f32 * (1.0 / 512.0);
    let v = if x < 8 {
        sub
    } else if x == 0x7f {
        f32::NAN
    } else {
        normal
    };
    f32::from_bits(v.to_bits() | sign)
}

/// Rounds a positive normal f32 up to the next power of two (identity on powers of two).
#[inline]
pub const fn round_up_pow2(s: f32) -> f32 {
    let bits = s.to_bits();
    if bits & 0x7f_ffff == 0 {
        s
    } else {
        f32::from_bits((bits & 0x7f80_0000) + 0x80_0000)
    }
}

/// Per-token index-K scale from the token's `amax`; `pow2` rounds up to a power of two
/// (the "ue8m0" format).
#[inline]
pub const fn index_k_scale(amax: f32, pow2: bool) -> f32 {
    let s = amax.max(SCALE_FLOOR) / E4M3_MAX;
    if pow2 {
        round_up_pow2(s)
    } else {
        s
    }
}

/// Per-tile fp8_ds_mla scale from the tile's `amax`.
#[inline]
pub fn kv_tile_scale(amax: f32) -> f32 {
    round_up_pow2((amax / E4M3_MAX).max(SCALE_FLOOR))
}

/// bf16 bits to f32 (exact).
#[inline(always)]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits((bits as u32) << 16)
}

/// f32 to bf16 bits: round to nearest, ties to even; NaN stays NaN (its top bits kept,
/// the quiet bit set); overflow rounds to ±inf. The same bits as `half::bf16::from_f32`,
/// which the CPU backend uses.
#[inline(always)]
pub fn f32_to_bf16(x: f32) -> u16 {
    let b = x.to_bits();
    if b & 0x7fff_ffff > 0x7f80_0000 {
        return ((b >> 16) | 0x0040) as u16;
    }
    let round = 0x8000u32;
    if b & round != 0 && b & (3 * round - 1) != 0 {
        (b >> 16) as u16 + 1
    } else {
        (b >> 16) as u16
    }
}

/// |x| of an f32 (clears the sign bit).
#[inline(always)]
pub fn abs(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
}

/// bf16 bits of one e4m3fn code (exact; NaN stays NaN), branch-free: the code's
/// exponent and mantissa placed in an f32 (a subnormal one for exponent 0) times 2^120
/// is the code's value exactly (needs subnormal f32 arithmetic, which PTX `mul.rn.f32`
/// without `.ftz` has), and it has at most 4 significant bits, so its top 16 bits are it.
#[inline(always)]
pub fn e4m3_to_bf16(code: u32) -> u32 {
    let x = code & 0x7f;
    let v = f32::from_bits(x << 20) * f32::from_bits(0x7b80_0000); // 2^120
    let mag = if x == 0x7f { 0x7fc0 } else { v.to_bits() >> 16 };
    mag | ((code & 0x80) << 8)
}

/// Two e4m3 codes (bytes 0 and 2 of `w`) with nonzero exponents and no NaN to two bf16
/// (low, high half-word): exponent field e (bias 7) → e + 120 (bias 127), the 3 mantissa
/// bits on top; no carry crosses the halves (each stays below 0x4400).
#[inline(always)]
fn normal_e4m3x2_to_bf16x2(w: u32) -> u32 {
    (((w & 0x007f_007f) << 4) + 0x3c00_3c00) | ((w & 0x0080_0080) << 8)
}

/// Whether all 4 codes of `w` are normal numbers (exponent ≠ 0, not NaN), bytewise.
#[inline(always)]
fn all_normal(w: u32) -> bool {
    let nonzero_exp = ((w & 0x7878_7878) + 0x7878_7878) & 0x8080_8080;
    let nan = ((w & 0x7f7f_7f7f) + 0x0101_0101) & 0x8080_8080;
    nonzero_exp == 0x8080_8080 && nan == 0
}

/// 8 e4m3 codes (little-endian in `lo`, `hi`) to 8 bf16 (exact).
#[inline(always)]
pub fn e4m3x8_to_bf16(lo: u32, hi: u32) -> [u32; 4] {
    if all_normal(lo) && all_normal(hi) {
        let spread_lo = |w: u32| (w & 0xff) | ((w & 0xff00) << 8);
        let spread_hi = |w: u32| ((w >> 16) & 0xff) | ((w >> 8) & 0x00ff_0000);
        [
            normal_e4m3x2_to_bf16x2(spread_lo(lo)),
            normal_e4m3x2_to_bf16x2(spread_hi(lo)),
            normal_e4m3x2_to_bf16x2(spread_lo(hi)),
            normal_e4m3x2_to_bf16x2(spread_hi(hi)),
        ]
    } else {
        let pair = |w: u32| e4m3_to_bf16(w & 0xff) | (e4m3_to_bf16((w >> 8) & 0xff) << 16);
        [pair(lo), pair(lo >> 16), pair(hi), pair(hi >> 16)]
    }
}

/// 4 e4m3 codes (little-endian in `w`) to 4 bf16 (exact), packed two per word (low
/// half-word = lower code).
#[inline(always)]
pub fn e4m3x4_to_bf16(w: u32) -> [u32; 2] {
    if all_normal(w) {
        [
            normal_e4m3x2_to_bf16x2((w & 0xff) | ((w & 0xff00) << 8)),
            normal_e4m3x2_to_bf16x2(((w >> 16) & 0xff) | ((w >> 8) & 0x00ff_0000)),
        ]
    } else {
        let pair = |w: u32| e4m3_to_bf16(w & 0xff) | (e4m3_to_bf16((w >> 8) & 0xff) << 16);
        [pair(w), pair(w >> 16)]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The straightforward (branchy) encoder the branch-free one must equal.
    fn encode_reference(x: f32) -> u8 {
        let bits = x.to_bits();
        let sign = ((bits >> 24) & 0x80) as u8;
        let a = f32::from_bits(bits & 0x7fff_ffff);
        if a.is_nan() {
            return sign | 0x7f;
        }
        if a >= E4M3_MAX {
            return sign | 0x7e;
        }
        // Nearest of the 127 finite magnitudes, ties to the even code.
        let mut best = 0u8;
        for c in 1..=0x7eu8 {
            let (dc, db) = ((decode_bits(c) - a).abs(), (decode_bits(best) - a).abs());
            if dc < db || (dc == db && c % 2 == 0) {
                best = c;
            }
        }
        sign | best
    }

    #[test]
    fn branch_free_encoder_matches_the_reference() {
        // Every high-20-bit pattern with a spread of low bits, plus midpoints of codes.
        let lows = [
            0u32, 1, 0x7_ffff, 0x8_0000, 0x8_0001, 0xf_ffff, 0x4_1234, 0xa_bcde,
        ];
        for hi in (0u32..1 << 12).map(|h| h << 20) {
            for &lo in &lows {
                for sign in [0, 0x8000_0000u32] {
                    let x = f32::from_bits(sign | hi | lo);
                    assert_eq!(
                        e4m3_encode(x),
                        encode_reference(x),
                        "{x:e} ({:#010x})",
                        x.to_bits()
                    );
                }
            }
        }
        for c in 0..0x7eu8 {
            let mid = (decode_bits(c) + decode_bits(c + 1)) / 2.0;
            for x in [
                mid,
                f32::from_bits(mid.to_bits() + 1),
                f32::from_bits(mid.to_bits() - 1),
            ] {
                assert_eq!(e4m3_encode(x), encode_reference(x), "{x:e}");
            }
        }
    }
    #[test]
    fn e4m3_to_bf16_is_exact_for_every_code() {
        let bf = |b: u32| f32::from_bits(b << 16);
        let same = |got: f32, want: f32| {
            if want.is_nan() {
                got.is_nan()
            } else {
                got.to_bits() == want.to_bits()
            }
        };
        for code in 0..256u32 {
            let want = e4m3_decode(code as u8);
            assert!(same(bf(e4m3_to_bf16(code)), want), "{code:#x}");
        }
        // Every code in every byte position, next to normal, zero and NaN neighbours.
        for code in 0..256u32 {
            for other in [0x38u32, 0x00, 0x80, 0x7f, 0x01, 0xc5] {
                for pos in 0..8 {
                    let mut bytes = [other; 8];
                    bytes[pos] = code;
                    let word = |b: &[u32]| b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24;
                    let out = e4m3x8_to_bf16(word(&bytes[..4]), word(&bytes[4..]));
                    let lo4 = e4m3x4_to_bf16(word(&bytes[..4]));
                    let hi4 = e4m3x4_to_bf16(word(&bytes[4..]));
                    assert_eq!(out, [lo4[0], lo4[1], hi4[0], hi4[1]]);
                    for (k, &b) in bytes.iter().enumerate() {
                        let got = bf((out[k / 2] >> (16 * (k % 2))) & 0xffff);
                        assert!(
                            same(got, e4m3_decode(b as u8)),
                            "{code:#x} {other:#x} {pos}"
                        );
                    }
                }
            }
        }
    }
}
