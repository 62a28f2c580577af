//! The integrity harness's pieces: the agentic workload, the reference and served runs,
//! the per-session comparison (first diverging turn and step) and the evidence table.
//!
//! The determinism oracle makes the comparison exact: a served session is corrupted iff
//! any generated token or any step's logits digest differs from the reference run (the
//! same requests, one at a time, with prefix cache, host tier and PD off, on the same
//! backend).

pub mod compare;
pub mod report;
pub mod repro;
pub mod run;
pub mod workload;

pub use compare::{compare, Divergence, Tally, Verdict};
pub use report::{render_table, EvidenceRow};
pub use run::{
    run_concurrent, run_reference, EngineTarget, HttpTarget, SessionTrace, Target, TurnFailure,
    TurnTrace,
};
pub use workload::{SessionPlan, TurnKind, TurnPlan, Workload, WorkloadConfig};
