//! Scalar math the kernels need beyond `core`: fused multiply-add, `sqrt`, `exp2`, `log2`,
//! and [`exp_portable`], an `exp` with the same bits on every target.
//!
//! On the GPU these are single PTX instructions (`fma.rn.f32`, `ex2.approx.ftz.f32`,
//! `lg2.approx.ftz.f32`; the approximations are within ~2 ulp over the ranges softmax
//! uses). On the host (the emulator, with std) they are the correctly rounded std
//! functions, so emulated and GPU results may differ in the last bits of `exp2`/`log2`
//! (never of `fma`). Without std and off the GPU the crate only type-checks kernels (no
//! `Simt` implementation exists there), and plain arithmetic stands in.

/// `a * b + c` with one rounding.
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            core::arch::asm!(
                "fma.rn.f32 {r}, {a}, {b}, {c};",
                r = out(reg32) r, a = in(reg32) a, b = in(reg32) b, c = in(reg32) c,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        r
    }
    #[cfg(all(not(target_arch = "nvptx64"), feature = "emu"))]
    {
        a.mul_add(b, c)
    }
    #[cfg(all(not(target_arch = "nvptx64"), not(feature = "emu")))]
    {
        a * b + c
    }
}

/// `2^x`.
#[inline(always)]
pub fn exp2(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            core::arch::asm!(
                "ex2.approx.ftz.f32 {r}, {x};",
                r = out(reg32) r, x = in(reg32) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        r
    }
    #[cfg(all(not(target_arch = "nvptx64"), feature = "emu"))]
    {
        x.exp2()
    }
    #[cfg(all(not(target_arch = "nvptx64"), not(feature = "emu")))]
    {
        let _ = x;
        f32::NAN
    }
}

/// `log2(x)` for `x > 0`.
#[inline(always)]
pub fn log2(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            core::arch::asm!(
                "lg2.approx.ftz.f32 {r}, {x};",
                r = out(reg32) r, x = in(reg32) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        r
    }
    #[cfg(all(not(target_arch = "nvptx64"), feature = "emu"))]
    {
        x.log2()
    }
    #[cfg(all(not(target_arch = "nvptx64"), not(feature = "emu")))]
    {
        let _ = x;
        f32::NAN
    }
}

/// `sqrt(x)`, correctly rounded on every target (`sqrt.rn.f32` on the GPU, the IEEE
/// square root on the host).
#[inline(always)]
pub fn sqrt(x: f32) -> f32 {
    #[cfg(target_arch = "nvptx64")]
    {
        let r: f32;
        // SAFETY: register-only arithmetic.
        unsafe {
            core::arch::asm!(
                "sqrt.rn.f32 {r}, {x};",
                r = out(reg32) r, x = in(reg32) x,
                options(pure, nomem, nostack, preserves_flags),
            );
        }
        r
    }
    #[cfg(all(not(target_arch = "nvptx64"), feature = "emu"))]
    {
        x.sqrt()
    }
    #[cfg(all(not(target_arch = "nvptx64"), not(feature = "emu")))]
    {
        let _ = x;
        f32::NAN
    }
}

/// `2^e` for `-126 ≤ e ≤ 127` (a normal power of two, built from its bits).
#[inline(always)]
fn pow2i(e: i32) -> f32 {
    f32::from_bits(((e + 127) as u32) << 23)
}

/// `exp(x)` within 2 ulp (normal results), built only from correctly rounded f32 adds,
/// multiplies and [`fma`]s, so the CPU, the emulator and every GPU compute the **same
/// bits** (unlike `exp2`, an approximation instruction on the GPU). The dense model ops
/// that need `exp` (SwiGLU's sigmoid) use it on every backend: the engine's outputs are
/// then identical across backends, not just batch-invariant within one.
///
/// `x = n·ln2 + r` with `n = round(x·log2 e)` and `|r| ≤ ln2/2` (ln2 split in a head
/// exact in 17 bits and a tail), `exp(r)` a degree-7 Taylor polynomial by Horner,
/// scaled by `2^n` in two exact-or-final-rounding steps (subnormal results round once).
/// NaN stays NaN, `+inf` and `x > 88.73` give `+inf`, `x < -103.98` gives `+0`.
#[inline(always)]
pub fn exp_portable(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    if x > 88.73 {
        return f32::INFINITY;
    }
    if x < -103.98 {
        return 0.0;
    }
    // Round to nearest integer: adding 1.5·2^23 leaves no fraction bits (|x·log2 e| < 2^22).
    const SHIFTER: f32 = 12_582_912.0;
    let n = (x * LOG2_E + SHIFTER) - SHIFTER;
    const LN2_HI: f32 = 0.693_145_75; // 0x3f317200: 17 significant bits, n·LN2_HI exact
    const LN2_LO: f32 = 1.428_606_8e-6; // ln 2 − LN2_HI
    let r = fma(-n, LN2_HI, x);
    let r = fma(-n, LN2_LO, r);
    let mut p = 1.0 / 5040.0;
    p = fma(p, r, 1.0 / 720.0);
    p = fma(p, r, 1.0 / 120.0);
    p = fma(p, r, 1.0 / 24.0);
    p = fma(p, r, 1.0 / 6.0);
    p = fma(p, r, 0.5);
    p = fma(p, r, 1.0);
    p = fma(p, r, 1.0);
    let n = n as i32;
    let half = n / 2;
    p * pow2i(half) * pow2i(n - half)
}

/// `log2(e)`: `exp(x) = exp2(x · LOG2_E)`.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// `ln(2)`: `ln(x) = log2(x) · LN_2`.
pub const LN_2: f32 = core::f32::consts::LN_2;

#[cfg(all(test, feature = "emu"))]
mod tests {
    use super::*;

    /// Distance in units in the last place between an f32 and the exact value.
    fn ulps(got: f32, want: f64) -> f64 {
        let w = want as f32;
        let ulp = (f32::from_bits(w.to_bits() + 1) - w).abs() as f64;
        (got as f64 - want).abs() / ulp.max(f64::from(f32::from_bits(1)))
    }

    #[test]
    fn exp_portable_is_within_2_ulp_and_handles_the_edges() {
        let mut worst = 0f64;
        // Every 97th f32 bit pattern in the finite-result range, both signs.
        let mut b = 0u32;
        while b < 0x42b2_0000 {
            for x in [f32::from_bits(b), -f32::from_bits(b)] {
                let want = (x as f64).exp();
                if want >= f32::MIN_POSITIVE as f64 && want <= f32::MAX as f64 {
                    worst = worst.max(ulps(exp_portable(x), want));
                }
            }
            b += 97;
        }
        assert!(worst <= 2.0, "worst error {worst} ulp");
        assert_eq!(exp_portable(0.0), 1.0);
        assert_eq!(exp_portable(f32::INFINITY), f32::INFINITY);
        assert_eq!(exp_portable(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp_portable(89.0), f32::INFINITY);
        assert_eq!(exp_portable(-104.0), 0.0);
        assert!(exp_portable(f32::NAN).is_nan());
        // Subnormal results: within one subnormal step of the exact value.
        for x in [-88.0f32, -95.5, -100.0, -103.0] {
            let want = (x as f64).exp();
            let step = f32::from_bits(1) as f64;
            assert!((exp_portable(x) as f64 - want).abs() <= step, "{x}");
        }
        // Large finite results stay finite up to the overflow threshold.
        assert!(exp_portable(88.7).is_finite());
    }

    #[test]
    fn sqrt_is_correctly_rounded() {
        for x in [2.0f32, 1e-30, 3.0e38, 0.0, 7.0] {
            assert_eq!(sqrt(x), (x as f64).sqrt() as f32);
        }
        assert!(sqrt(-1.0).is_nan());
    }
}
