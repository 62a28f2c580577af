//! Element types: bf16 (via `half`), fp8 e4m3fn, and the fp32 quantization scales.
//!
//! Conventions (the contract every backend and reference implements):
//! - [`e4m3_encode`] rounds to nearest, ties to even, **saturates** to ±448 (±inf included)
//!   and keeps NaN (sign preserved, code `0x7f | sign`). This equals
//!   `np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)`.
//! - Index-K per-token scale: `max(amax, 1e-4) / 448` in f32, optionally rounded up to a
//!   power of two ([`ScaleFormat::Ue8m0`]).
//! - fp8_ds_mla per-tile scale: `2^ceil(log2(max(amax / 448, 1e-4)))` in f32.
//! - A value is quantized as `e4m3_encode(x / scale)` with an f32 division.

pub use half::bf16;
use serde::{Deserialize, Serialize};

/// Largest finite e4m3fn magnitude.
pub const E4M3_MAX: f32 = 448.0;
/// Floor applied to `amax` (index-K) or `amax / 448` (KV tiles) before computing a scale.
pub const SCALE_FLOOR: f32 = 1e-4;

/// How an fp32 quantization scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleFormat {
    /// The exact f32 quotient `max(amax, 1e-4) / 448`.
    Fp32,
    /// The quotient rounded up to a power of two (an exponent-only "ue8m0" value), stored as f32.
    Ue8m0,
}

/// Encodes an f32 as fp8 e4m3fn: round-to-nearest-even, saturating to ±448, NaN kept.
#[inline]
pub fn e4m3_encode(x: f32) -> u8 {
    let bits = x.to_bits();
    let sign = ((bits >> 24) & 0x80) as u8;
    let a = x.abs();
    if a.is_nan() {
        return sign | 0x7f;
    }
    if a >= E4M3_MAX {
        return sign | 0x7e;
    }
    if a < 1.0 / 64.0 {
        // Subnormal range of e4m3 (exponent field 0): value = m * 2^-9, m in 0..=7.
        // `a * 512` is exact; a result of 8 is the smallest normal (code 0x08).
        let m = (a * 512.0).round_ties_even();
        return sign | m as u8;
    }
    let abits = a.to_bits();
    let exp = (abits >> 23) as i32 - 127; // -6..=8 here
    let mant = abits & 0x7f_ffff;
    let mut keep = mant >> 20;
    let rest = mant & 0xf_ffff;
    const HALF: u32 = 0x8_0000;
    if rest > HALF || (rest == HALF && keep & 1 == 1) {
        keep += 1;
    }
    let mut e = exp + 7;
    if keep == 8 {
        keep = 0;
        e += 1;
    }
    // a < 448 guarantees the result is at most 448 (code 0x7e): never the NaN code 0x7f.
    sign | ((e as u8) << 3) | keep as u8
}

/// Decodes an fp8 e4m3fn code to f32 (exact).
#[inline]
pub fn e4m3_decode(code: u8) -> f32 {
    E4M3_TABLE[code as usize]
}

/// All 256 e4m3fn codes decoded; index with the code.
pub static E4M3_TABLE: [f32; 256] = build_e4m3_table();

const fn build_e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        let e = (c >> 3) & 0xf;
        let m = c & 7;
        let mag = if e == 0xf && m == 7 {
            f32::NAN
        } else if e == 0 {
            // m * 2^-9
            f32::from_bits(if m == 0 { 0 } else { subnormal_bits(m as u32) })
        } else {
            // (1 + m/8) * 2^(e-7): f32 exponent field e - 7 + 127, mantissa m << 20.
            f32::from_bits((((e + 120) as u32) << 23) | ((m as u32) << 20))
        };
        t[c] = if c & 0x80 != 0 { -mag } else { mag };
        c += 1;
    }
    t
}

/// Bits of the f32 equal to `m * 2^-9` for m in 1..=7 (a normal f32).
const fn subnormal_bits(m: u32) -> u32 {
    // Normalise m = 1.f * 2^p with p = floor(log2 m).
    let p = 31 - m.leading_zeros();
    let frac = (m << (23 - p)) & 0x7f_ffff;
    ((p + 127 - 9) << 23) | frac
}

/// Rounds a positive normal f32 up to the next power of two (identity on powers of two).
#[inline]
pub fn round_up_pow2(s: f32) -> f32 {
    let bits = s.to_bits();
    if bits & 0x7f_ffff == 0 {
        s
    } else {
        f32::from_bits((bits & 0x7f80_0000) + 0x80_0000)
    }
}

/// Per-token index-K scale from the token's `amax` (largest |value|).
#[inline]
pub fn index_k_scale(amax: f32, format: ScaleFormat) -> f32 {
    let s = amax.max(SCALE_FLOOR) / E4M3_MAX;
    match format {
        ScaleFormat::Fp32 => s,
        ScaleFormat::Ue8m0 => round_up_pow2(s),
    }
}

/// Per-tile fp8_ds_mla scale: `2^ceil(log2(max(amax / 448, 1e-4)))`.
#[inline]
pub fn kv_tile_scale(amax: f32) -> f32 {
    round_up_pow2((amax / E4M3_MAX).max(SCALE_FLOOR))
}

/// Largest |x| over bf16 values, as f32 (NaN ignored).
#[inline]
pub fn amax_bf16(xs: &[bf16]) -> f32 {
    xs.iter().fold(0f32, |m, &x| m.max(x.to_f32().abs()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_table_landmarks() {
        assert_eq!(e4m3_decode(0x00), 0.0);
        assert_eq!(e4m3_decode(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x07), 7.0 * 2f32.powi(-9));
        assert_eq!(e4m3_decode(0x08), 2f32.powi(-6));
        assert_eq!(e4m3_decode(0x38), 1.0);
        assert_eq!(e4m3_decode(0x7e), 448.0);
        assert_eq!(e4m3_decode(0xfe), -448.0);
        assert!(e4m3_decode(0x7f).is_nan());
        assert!(e4m3_decode(0xff).is_nan());
    }

    #[test]
    fn encode_roundtrips_every_code() {
        for c in 0u8..=255 {
            let v = e4m3_decode(c);
            if v.is_nan() {
                assert_eq!(e4m3_encode(v) & 0x7f, 0x7f);
            } else if v == 0.0 {
                assert_eq!(e4m3_encode(v) & 0x7f, 0);
            } else {
                assert_eq!(e4m3_encode(v), c, "code {c:#x} value {v}");
            }
        }
    }

    #[test]
    fn encode_saturates_and_rounds_ties_to_even() {
        assert_eq!(e4m3_encode(1e9), 0x7e);
        assert_eq!(e4m3_encode(f32::INFINITY), 0x7e);
        assert_eq!(e4m3_encode(f32::NEG_INFINITY), 0xfe);
        assert_eq!(e4m3_encode(460.0), 0x7e);
        // 1 + 1/16 is the midpoint of 1.0 (even, 0x38) and 1.125 (0x39).
        assert_eq!(e4m3_encode(1.0625), 0x38);
        // 1.125 + 1/16 is the midpoint of 0x39 (odd) and 0x3a (even).
        assert_eq!(e4m3_encode(1.1875), 0x3a);
        // Half the smallest subnormal ties to zero; just above rounds up.
        assert_eq!(e4m3_encode(2f32.powi(-10)), 0x00);
        assert_eq!(e4m3_encode(2f32.powi(-10) * 1.0001), 0x01);
    }

    #[test]
    fn scales() {
        assert_eq!(index_k_scale(0.0, ScaleFormat::Fp32), 1e-4 / 448.0);
        assert_eq!(index_k_scale(448.0, ScaleFormat::Fp32), 1.0);
        assert_eq!(index_k_scale(300.0, ScaleFormat::Ue8m0), 1.0);
        assert_eq!(index_k_scale(448.0, ScaleFormat::Ue8m0), 1.0);
        assert_eq!(index_k_scale(449.0, ScaleFormat::Ue8m0), 2.0);
        assert_eq!(kv_tile_scale(0.0), round_up_pow2(1e-4));
        assert_eq!(kv_tile_scale(896.0), 2.0);
        assert_eq!(round_up_pow2(0.75), 1.0);
        assert_eq!(round_up_pow2(0.5), 0.5);
    }
}
