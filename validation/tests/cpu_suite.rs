//! The conformance suite on the CPU backend (one `#[test]` per check, fresh seed every run,
//! printed on failure; `SPARSEKIT_SEED` replays it).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

use sparsekit_host::CpuBackend;

sparsekit_validation::test_backend!(cpu, Ok(CpuBackend::new()));
