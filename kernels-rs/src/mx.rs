//! Microscaling codecs of DeepSeek-V4's caches, shared by the kernels and the host (which
//! re-exports them from `sparsekit_host::dtype`). Pure integer/f32 arithmetic, `no_std`.
//!
//! - **ue8m0** scale bytes: a power of two `2^(b − 127)` stored as its biased exponent `b`
//!   (`0xff` is NaN; byte 0 is `2^-127`). Used by MODEL1 KV tiles (64 values each) and fp4
//!   index-K groups (32 values each).
//! - **e2m1** (fp4) codes: sign bit 3, magnitudes `{0, 0.5, 1, 1.5, 2, 3, 4, 6}` for codes
//!   0..=7, round to nearest with ties to the even code, saturating at 6.
//! - fp4 group scale: `2^max(ceil(log2(amax / 6)), −126)` (amax 0 gives `2^-126`). A group
//!   holding NaN or ±inf is stored as scale byte `0xff` with every code 0, so all of its
//!   values read back as NaN.

/// ue8m0 byte of a NaN (and of an infinite) scale.
pub const UE8M0_NAN: u8 = 0xff;
/// Largest e2m1 magnitude.
pub const E2M1_MAX: f32 = 6.0;
/// Smallest fp4 group scale: `2^-126` (the smallest normal f32).
pub const FP4_SCALE_MIN: f32 = f32::from_bits(0x0080_0000);

/// The ue8m0 byte of a scale that is a power of two (normal f32), `0xff` for ±inf and NaN.
#[inline(always)]
pub fn ue8m0_encode(s: f32) -> u8 {
    let e = (s.to_bits() >> 23) & 0xff;
    e as u8
}

/// The scale a ue8m0 byte stands for: `2^(b − 127)` (byte 0: `2^-127`, a subnormal f32),
/// NaN for `0xff`.
#[inline(always)]
pub fn ue8m0_to_f32(b: u8) -> f32 {
    let bits = match b {
        0 => 0x0040_0000,
        0xff => 0x7fc0_0000,
        _ => (b as u32) << 23,
    };
    f32::from_bits(bits)
}

/// Value of an e2m1 code (bits 0..4 of `code`; higher bits ignored). Arithmetic only (no
/// table in local memory on the GPU): exponent field `e`, mantissa bit `f`; `e = 0` is
/// `f / 2`, else `(2 + f) · 2^(e − 2)`.
#[inline(always)]
pub fn e2m1_to_f32(code: u8) -> f32 {
    let m = (code & 7) as u32;
    let (e, f) = (m >> 1, (m & 1) as f32);
    let normal = (2.0 + f) * f32::from_bits((125 + e) << 23);
    let mag = if e == 0 { 0.5 * f } else { normal };
    f32::from_bits(mag.to_bits() | ((code as u32 & 8) << 28))
}

/// Four e2m1 codes (bits `4j..4j + 4` of `codes`, j = 0..4) times `scale` as four bf16
/// (two per u32, element 0 low): exact for a power-of-two scale whose products stay in
/// range (at most 2 significant bits; subnormals kept), NaN for a NaN scale.
#[inline(always)]
pub fn e2m1x4_to_bf16(codes: u32, scale: f32) -> [u32; 2] {
    let bf = |j: u32| (e2m1_to_f32((codes >> (4 * j)) as u8) * scale).to_bits() >> 16;
    [bf(0) | bf(1) << 16, bf(2) | bf(3) << 16]
}

/// e2m1 code of `x` (low 4 bits): round to nearest, ties to the even code, saturating at
/// ±6; NaN gives code 0 with NaN's sign bit. Branch-free: the magnitude code counts the
/// decision thresholds `a` passes (a tie stays on the even side).
#[inline(always)]
pub fn e2m1_encode(x: f32) -> u8 {
    let sign = ((x.to_bits() >> 28) & 8) as u8;
    let a = f32::from_bits(x.to_bits() & 0x7fff_ffff);
    let code = (a > 0.25) as u8
        + (a >= 0.75) as u8
        + (a > 1.25) as u8
        + (a >= 1.75) as u8
        + (a > 2.5) as u8
        + (a >= 3.5) as u8
        + (a > 5.0) as u8;
    sign | code
}

/// The fp4 group scale of a group whose largest magnitude is `amax` (finite, ≥ 0):
/// `2^max(ceil(log2(amax / 6)), −126)`. (`amax / 6` in f32 never rounds across a power of
/// two for a bf16 `amax`, so this equals the exact rule.)
#[inline(always)]
pub fn fp4_group_scale(amax: f32) -> f32 {
    crate::fp8::round_up_pow2((amax / E2M1_MAX).max(FP4_SCALE_MIN))
}

/// The ue8m0 byte of the scale of an e4m3 group whose largest magnitude is `amax` (≥ 0):
/// the smallest power of two `s ≥ 2^-127` with `amax / s ≤ 448` (byte 127, scale 1, for
/// `amax = 0`; [`UE8M0_NAN`] for a NaN or infinite `amax`). No floor beyond the format's:
/// the MXFP8 split of the queries keeps small groups at full precision. (`amax / 448` in
/// f32 never rounds across a power of two for a bf16 `amax`.)
#[inline(always)]
pub fn e4m3_scale_byte(amax: f32) -> u8 {
    let q = (amax / crate::fp8::E4M3_MAX).to_bits();
    let (e, m) = (q >> 23, q & 0x7f_ffff);
    let b = if e == 0 {
        // Subnormal quotient: 2^-127 (byte 0) covers up to 2^-127, else 2^-126.
        (q > 0x0040_0000) as u32
    } else {
        e + (m != 0) as u32
    };
    let b = if amax == 0.0 { 127 } else { b };
    if amax.is_finite() {
        b as u8
    } else {
        UE8M0_NAN
    }
}

/// `1 / s` for the scale `s` of a ue8m0 byte `b ≤ 253`: `2^(127 − b)`, exact; 0 for 254
/// and [`UE8M0_NAN`] (a NaN group's codes are then NaN or 0, and its scale NaN).
#[inline(always)]
pub fn ue8m0_inverse(b: u8) -> f32 {
    f32::from_bits(254u32.saturating_sub(b as u32) << 23)
}

/// One value's high part in the two-part e4m3 split of a group (`v ≈ s·hi + s_lo·lo`,
/// used for bf16 queries on the block-scaled mma): the code `hi = e4m3(v · inv)` and the
/// remainder `v − s·hi`, exact in f32 (`s` the group's power-of-two scale, `inv = 1 / s`).
#[inline(always)]
pub fn e4m3_hi_part(v: f32, s: f32, inv: f32) -> (u8, f32) {
    let c = crate::fp8::e4m3_encode(v * inv);
    (c, v - crate::fp8::e4m3_to_f32(c) * s)
}

/// Largest `|x|` bits over bf16 values (`bits & 0x7fff`): a result `≥ 0x7f80` means the
/// group holds NaN or ±inf.
#[inline(always)]
pub fn bf16_abs_bits_max(acc: u32, bits: u16) -> u32 {
    let a = (bits & 0x7fff) as u32;
    if a > acc {
        a
    } else {
        acc
    }
}

/// Whether a [`bf16_abs_bits_max`] result marks a non-finite group.
#[inline(always)]
pub fn abs_bits_non_finite(max_bits: u32) -> bool {
    max_bits >= 0x7f80
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The scale byte is the smallest power of two that keeps the group inside e4m3,
    /// everywhere from subnormal bf16 to the bf16 maximum.
    #[test]
    fn e4m3_scale_bytes_are_the_smallest_that_fit() {
        for bits in (0u32..0x7f80).step_by(7).chain([1, 0x7f7f]) {
            let amax = f32::from_bits(bits << 16);
            let b = e4m3_scale_byte(amax);
            if amax == 0.0 {
                assert_eq!(b, 127);
                continue;
            }
            let s = f64::from(ue8m0_to_f32(b));
            assert!(f64::from(amax) / s <= 448.0, "{amax:e}: byte {b}");
            if b > 0 {
                let smaller = f64::from(ue8m0_to_f32(b - 1));
                assert!(
                    f64::from(amax) / smaller > 448.0,
                    "{amax:e}: byte {b} not smallest"
                );
            }
            assert_eq!(ue8m0_inverse(b) as f64 * s, 1.0, "byte {b}");
        }
        assert_eq!(e4m3_scale_byte(f32::NAN), UE8M0_NAN);
        assert_eq!(e4m3_scale_byte(f32::INFINITY), UE8M0_NAN);
    }

    /// The two-part split of bf16 groups: exact for every value within 2^12 of the group's
    /// largest magnitude, off by less than 2^-22 of it otherwise (the claim of
    /// `sparse_mla_v4`'s block-scaled path), over groups spanning many binades.
    #[test]
    fn two_part_e4m3_split_of_bf16_groups() {
        let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ u64::from(std::process::id());
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut exact_checked, mut small_checked) = (0, 0);
        for _ in 0..20_000 {
            // 32 bf16 values: a random top binade, each value up to 30 binades below it.
            let top = 60 + (next() % 140) as u32;
            let g: Vec<f32> = (0..32)
                .map(|_| {
                    let r = next();
                    let e = top - (r % 31) as u32;
                    let bits = ((r >> 8) & 0x8000) as u32 | e << 7 | ((r >> 16) & 0x7f) as u32;
                    f32::from_bits(bits << 16)
                })
                .collect();
            let amax = g.iter().fold(0f32, |m, v| m.max(v.abs()));
            let sa = e4m3_scale_byte(amax);
            let (s, inv) = (ue8m0_to_f32(sa), ue8m0_inverse(sa));
            let parts: Vec<(u8, f32)> = g.iter().map(|&v| e4m3_hi_part(v, s, inv)).collect();
            let ramax = parts.iter().fold(0f32, |m, p| m.max(p.1.abs()));
            let sb = e4m3_scale_byte(ramax);
            let (s_lo, inv_lo) = (ue8m0_to_f32(sb), ue8m0_inverse(sb));
            for (&v, &(hi, r)) in g.iter().zip(&parts) {
                let lo = crate::fp8::e4m3_encode(r * inv_lo);
                let got = f64::from(crate::fp8::e4m3_to_f32(hi)) * f64::from(s)
                    + f64::from(crate::fp8::e4m3_to_f32(lo)) * f64::from(s_lo);
                let err = (got - f64::from(v)).abs();
                if v.abs() >= amax * 2f32.powi(-12) {
                    assert_eq!(err, 0.0, "{v:e} in a group of amax {amax:e}: {got:e}");
                    exact_checked += 1;
                } else {
                    assert!(err < f64::from(amax) * 2f64.powi(-22), "{v:e}: {got:e}");
                    small_checked += 1;
                }
            }
        }
        assert!(exact_checked > 100_000 && small_checked > 10_000);
    }

    #[test]
    fn e2m1_round_trips_and_ties_go_even() {
        for c in 0..16u8 {
            let v = e2m1_to_f32(c);
            if c != 8 {
                assert_eq!(e2m1_encode(v), c, "{v}");
            }
        }
        for (x, c) in [
            (0.25, 0),
            (0.26, 1),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (5.01, 7),
            (100.0, 7),
            (f32::INFINITY, 7),
            (-0.75, 10),
        ] {
            assert_eq!(e2m1_encode(x), c, "{x}");
        }
        assert_eq!(e2m1_encode(f32::NAN) & 7, 0);
    }

    #[test]
    fn ue8m0_and_group_scales() {
        assert_eq!(ue8m0_encode(1.0), 127);
        assert_eq!(ue8m0_encode(0.5), 126);
        assert_eq!(ue8m0_encode(f32::INFINITY), 0xff);
        assert_eq!(ue8m0_to_f32(127), 1.0);
        assert_eq!(ue8m0_to_f32(0), 2f32.powi(-127));
        assert!(ue8m0_to_f32(0xff).is_nan());
        for b in 1..255u8 {
            assert_eq!(ue8m0_encode(ue8m0_to_f32(b)), b);
        }
        assert_eq!(fp4_group_scale(6.0), 1.0);
        assert_eq!(fp4_group_scale(6.5), 2.0);
        assert_eq!(fp4_group_scale(3.0), 0.5);
        assert_eq!(fp4_group_scale(0.0), FP4_SCALE_MIN);
        assert_eq!(ue8m0_encode(FP4_SCALE_MIN), 1);
    }
}
