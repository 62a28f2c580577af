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
pub fn round_up_pow2(s: f32) -> f32 {
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
pub fn index_k_scale(amax: f32, pow2: bool) -> f32 {
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

/// |x| of an f32 (clears the sign bit).
#[inline(always)]
pub fn abs(x: f32) -> f32 {
    f32::from_bits(x.to_bits() & 0x7fff_ffff)
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
}
