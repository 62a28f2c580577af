//! The server's integration tests, one module per file beside this one, built as one test
//! binary: each binary of its own links the whole server and compiles its generic code
//! again (13 binaries took 285 s of CPU to build, this one 87 s; `benches/RESULTS.md`).
//!
//! Run one file's tests with its module name as the filter, e.g.
//! `cargo test -p sparsekit-server --test integration harness::`.
//!
//! Nothing here may rely on being alone in its process: the tests of every module share
//! one, two at a time by default. No test sets environment variables or process-wide
//! state; the NIXL tests, whose runtime is opened once per process, run their NIXL parts
//! in child processes of this binary (`pd_nixl`).

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests may panic

mod common;
mod pd_common;

mod backends;
mod cache;
mod engine;
mod engine_misuse;
mod harness;
mod http;
mod http_users;
mod pd_faults;
mod pd_local;
mod pd_misuse;
mod pd_nixl;
mod pd_nodes;
mod pd_wire;
