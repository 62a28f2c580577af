//! Element types: bf16 (via `half`), fp8 e4m3fn, and the fp32 quantization scales. The
//! codec itself lives in `sparsekit_kernels::fp8` so device kernels and host share one
//! implementation.
//!
//! Conventions (the contract every backend and reference implements):
//! - [`e4m3_encode`] rounds to nearest, ties to even, **saturates** to ±448 (±inf included)
//!   and keeps NaN (sign preserved, code `0x7f | sign`). This equals
//!   `np.clip(x, -448, 448).astype(ml_dtypes.float8_e4m3fn)`.
//! - Index-K per-token scale: `max(amax, 1e-4) / 448` in f32, optionally rounded up to a
//!   power of two ([`ScaleFormat::Ue8m0`]).
//! - fp8_ds_mla per-tile scale: `2^ceil(log2(max(amax / 448, 1e-4)))` in f32.
//! - A value is quantized as `e4m3_encode(x / scale)` with an f32 division.
//! - The amax ignores NaN. **A token (index-K) or tile (fp8_ds_mla) holding ±inf** has
//!   amax `inf`, hence scale `inf` (ue8m0 and power-of-two scales too): its finite values
//!   quantize to `x / inf = ±0` (code `0x00`/`0x80`) and its ±inf to `inf / inf = NaN`
//!   (a NaN code, `0x7f` or `0xff`: the sign of that NaN is the platform's — x86 sets it,
//!   NVIDIA GPUs do not), and every value of it reads back as NaN (`0 · inf`), as with
//!   DeepSeek's quantiser; the saturation to ±448 above applies to the encoder alone, never
//!   to a scaled store. A NaN value stores the NaN code and leaves the others as they are.
//!   bf16 index keys and the bf16 parts of KV (all of bf16 KV, the fp8_ds_mla rope) store
//!   ±inf and NaN as they are.

pub use half::bf16;
use serde::{Deserialize, Serialize};

pub use sparsekit_kernels::fp8::{
    e4m3_decode, e4m3_encode, round_up_pow2, E4M3_MAX, E4M3_TABLE, SCALE_FLOOR,
};

/// How an fp32 quantization scale is stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScaleFormat {
    /// The exact f32 quotient `max(amax, 1e-4) / 448`.
    Fp32,
    /// The quotient rounded up to a power of two (an exponent-only "ue8m0" value), stored as f32.
    Ue8m0,
}

/// Per-token index-K scale from the token's `amax` (largest |value|).
#[inline]
pub fn index_k_scale(amax: f32, format: ScaleFormat) -> f32 {
    sparsekit_kernels::fp8::index_k_scale(amax, format == ScaleFormat::Ue8m0)
}

/// Per-tile fp8_ds_mla scale: `2^ceil(log2(max(amax / 448, 1e-4)))`.
#[inline]
pub fn kv_tile_scale(amax: f32) -> f32 {
    sparsekit_kernels::fp8::kv_tile_scale(amax)
}

/// Largest |x| over bf16 values, as f32 (NaN ignored).
#[inline]
pub fn amax_bf16(xs: &[bf16]) -> f32 {
    // The bf16 → f32 widening is a shift (half's `to_f32` quiets NaNs with a branch that
    // keeps this loop from vectorising; NaN is ignored here either way).
    xs.iter().fold(0f32, |m, &x| {
        m.max(sparsekit_kernels::fp8::abs(
            sparsekit_kernels::fp8::bf16_to_f32(x.to_bits()),
        ))
    })
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
    fn arithmetic_decode_matches_the_table() {
        for c in 0..=255u8 {
            let (a, b) = (sparsekit_kernels::fp8::e4m3_to_f32(c), e4m3_decode(c));
            assert!(
                a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan()),
                "{c:#x}"
            );
        }
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
