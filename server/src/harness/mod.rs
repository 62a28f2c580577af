//! The integrity harness's pieces: the agentic workload, the configurations and fault
//! injections, who serves a configuration (in process, server processes over NIXL, or
//! running servers), the reference
//! and served runs, the per-session comparison (first diverging turn and step), metrics
//! scraping and the evidence table.
//!
//! The determinism oracle makes the comparison exact: a served session is corrupted iff
//! any generated token or any step's logits digest differs from the reference run (the
//! same requests, one at a time, with prefix cache, host tier and PD off, on the same
//! backend).

pub mod compare;
pub mod config;
pub mod deploy;
pub mod process;
pub mod report;
pub mod repro;
pub mod run;
pub mod scrape;
pub mod workload;

pub use compare::{compare, Divergence, Tally, Verdict};
pub use config::{ConfigKey, Injection};
pub use deploy::{ConfigRunner, Deployment, LocalRunner, RunPlan, Sizing, UrlRunner};
pub use report::{render_table, EvidenceRow};
pub use repro::{run_repro, ReproOptions, ReproReport};
pub use run::{
    run_concurrent, run_reference, AbortingTarget, EngineTarget, HttpTarget, SessionTrace, Target,
    TurnFailure, TurnTrace,
};
pub use workload::{SessionPlan, TurnKind, TurnPlan, Workload, WorkloadConfig};
