//! Scalar math the kernels need beyond `core`: fused multiply-add, `exp2` and `log2`.
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

/// `log2(e)`: `exp(x) = exp2(x · LOG2_E)`.
pub const LOG2_E: f32 = core::f32::consts::LOG2_E;
/// `ln(2)`: `ln(x) = log2(x) · LN_2`.
pub const LN_2: f32 = core::f32::consts::LN_2;
