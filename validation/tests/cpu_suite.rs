//! The conformance suite on the CPU backend, once per vector path (AVX-512, AVX2,
//! portable): every path this CPU supports must pass; a path it lacks prints why it
//! skipped. One `#[test]` per check, fresh seed every run (printed on failure;
//! `SPARSEKIT_SEED` replays it).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_host::cpu::{CpuIsa, Isa};
use sparsekit_host::CpuBackend;

sparsekit_validation::test_backend!(cpu_avx512, CpuBackend::with_isa(Isa::Avx512));
sparsekit_validation::test_backend!(cpu_avx2, CpuBackend::with_isa(Isa::Avx2));
sparsekit_validation::test_backend!(cpu_scalar, CpuBackend::with_isa(Isa::Scalar));

#[test]
fn the_default_backend_runs_the_process_default_path() {
    assert_eq!(CpuBackend::new().isa(), CpuIsa::get().isa());
    assert!(CpuIsa::get().isa().supported());
    assert_eq!(
        CpuBackend::with_isa(Isa::Scalar).unwrap().isa(),
        Isa::Scalar
    );
    for isa in Isa::ALL {
        assert_eq!(CpuBackend::with_isa(isa).is_ok(), isa.supported(), "{isa}");
    }
}
