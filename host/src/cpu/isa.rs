//! The vector instruction set the CPU kernels are compiled for at run time. Every path
//! performs the same correctly rounded operations in the same order, so results never
//! depend on which one runs.

use std::sync::OnceLock;

/// Widest usable vector ISA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512F and AVX-512BW with FMA.
    Avx512,
    /// AVX2 with FMA.
    Avx2,
    /// Portable code (`mul_add` via libm where the CPU has no FMA).
    Scalar,
}

impl Isa {
    /// Detected once per process.
    pub fn get() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(detect)
    }
}

#[cfg(target_arch = "x86_64")]
fn detect() -> Isa {
    let fma = std::arch::is_x86_feature_detected!("fma");
    if fma
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
    {
        Isa::Avx512
    } else if fma && std::arch::is_x86_feature_detected!("avx2") {
        Isa::Avx2
    } else {
        Isa::Scalar
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn detect() -> Isa {
    Isa::Scalar
}
