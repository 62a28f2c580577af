//! The CPU backend's vector paths side by side in one run: every case is built once and
//! timed on each path in alternation (round by round, so that every path sees the same
//! load on a shared machine), each path read against its own roofline (its f32 FMA peak,
//! and on `avx512bf16` the bf16 dot-product peak for the bf16 dot products: the best of
//! full measurements before and after the cases and short ones before every case; the
//! copy bandwidth is the best over every measurement of the run, since no path changes
//! it).

use std::fmt::Write as _;

use serde::Serialize;
use sparsekit_host::cpu::CpuIsa;
use sparsekit_host::{CpuBackend, Result};

use crate::report::{bound_name, fmt_time, Machine, Row};
use crate::roofline::{self, Effort, Roofline};
use crate::runner::{self, RunOptions};
use crate::Suite;

/// One path's results.
#[derive(Clone, Debug, Serialize)]
pub struct PathResult {
    /// The path's name (`avx512bf16`, `avx512`, `avx2`, `scalar`).
    pub isa: &'static str,
    /// The ceilings its rows are read against (the best of `roofline_runs`, the copy
    /// bandwidth the best of the whole run).
    pub roofline: Roofline,
    pub roofline_runs: Vec<Roofline>,
    pub results: Vec<Row>,
}

/// Every path of one side-by-side run.
#[derive(Clone, Debug, Serialize)]
pub struct PathsReport {
    pub date: String,
    pub machine: Machine,
    /// Rounds of alternation; each path's median is over `rounds × samples` calls.
    pub rounds: usize,
    pub samples_per_round: usize,
    pub paths: Vec<PathResult>,
}

/// Times `suite` on each path of `isas` side by side (module docs).
pub fn run_paths(
    isas: &[CpuIsa],
    suite: &Suite,
    effort: Effort,
    opts: RunOptions,
    rounds: usize,
    progress: impl FnMut(&str),
) -> Result<PathsReport> {
    let backends = isas
        .iter()
        .map(|i| CpuBackend::with_isa(i.isa()))
        .collect::<Result<Vec<_>>>()?;
    let before: Vec<Roofline> = isas
        .iter()
        .map(|&i| roofline::measure_path(i, effort))
        .collect();
    // On a shared machine a ceiling measured once can come out low: each path's compute
    // peaks are measured again before every case (short runs) and the best is kept.
    let mut probes: Vec<(f64, f64)> = vec![(0.0, 0.0); isas.len()];
    let probe = |probes: &mut Vec<(f64, f64)>| {
        if effort == Effort::Full {
            for (p, &i) in probes.iter_mut().zip(isas) {
                let fma = roofline::fma_peak_of(i, 0.05, 3).0;
                let dot = roofline::bf16_dot_peak(i, 0.05, 3);
                *p = (p.0.max(fma), p.1.max(dot));
            }
        }
    };
    let mut progress = progress;
    let out = runner::run_side_by_side(&backends, suite, opts, rounds, |name| {
        probe(&mut probes);
        progress(name)
    })?;
    let after: Vec<Roofline> = isas
        .iter()
        .map(|&i| roofline::measure_path(i, effort))
        .collect();
    let copy = before
        .iter()
        .chain(&after)
        .map(|r| r.copy_bytes_per_s)
        .fold(0.0, f64::max);
    let paths = isas
        .iter()
        .zip(out)
        .zip(before.into_iter().zip(after))
        .zip(probes)
        .map(|(((isa, out), (b, a)), (fma, dot))| {
            let mut roof = b.best_of(&a);
            roof.copy_bytes_per_s = copy;
            roof.fma_flops_per_s = roof.fma_flops_per_s.max(fma);
            roof.bf16_dot_flops_per_s = roof.bf16_dot_flops_per_s.max(dot);
            PathResult {
                isa: isa.isa().name(),
                roofline: roof,
                roofline_runs: vec![b, a],
                results: out.rows(&roof),
            }
        })
        .collect();
    Ok(PathsReport {
        date: crate::report::utc_date(),
        machine: Machine::detect(),
        rounds: rounds.max(1),
        samples_per_round: opts.samples.max(1),
        paths,
    })
}

impl PathsReport {
    /// The ceilings of every path, then one Markdown table: per case, each path's median
    /// and fraction of its roofline (the bound and its ceiling named once per row when
    /// all paths agree), and each path's speed-up over the last one.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let _ = writeln!(
            s,
            "machine: {} ({} logical CPUs, {} rayon threads), {}; {} round(s) × {} calls per path, paths alternating",
            self.machine.cpu,
            self.machine.logical_cpus,
            self.machine.rayon_threads,
            self.date,
            self.rounds,
            self.samples_per_round
        );
        for p in &self.paths {
            let r = &p.roofline;
            let _ = write!(
                s,
                "- {}: f32 FMA peak {:.1} GFLOP/s",
                p.isa,
                r.fma_flops_per_s / 1e9
            );
            if r.bf16_dot_flops_per_s > 0.0 {
                let _ = write!(
                    s,
                    ", bf16 dot-product peak {:.1} GFLOP/s",
                    r.bf16_dot_flops_per_s / 1e9
                );
            }
            if r.tile_flops_per_s > 0.0 {
                let _ = write!(s, ", AMX tile peak {:.1} GFLOP/s", r.tile_flops_per_s / 1e9);
            }
            let _ = writeln!(
                s,
                ", copy {:.1} GB/s (read+write)",
                r.copy_bytes_per_s / 1e9
            );
        }
        let _ = writeln!(s);
        let _ = write!(s, "| op | config | bound |");
        for p in &self.paths {
            let _ = write!(s, " {} median | {} fraction |", p.isa, p.isa);
        }
        let last = self.paths.last().map_or("", |p| p.isa);
        if self.paths.len() > 1 {
            for p in &self.paths[..self.paths.len() - 1] {
                let _ = write!(s, " {} vs {last} |", p.isa);
            }
        }
        let _ = writeln!(s);
        let _ = write!(s, "|---|---|---|");
        for _ in &self.paths {
            let _ = write!(s, "---:|---:|");
        }
        for _ in 1..self.paths.len() {
            let _ = write!(s, "---:|");
        }
        let _ = writeln!(s);
        let Some(first) = self.paths.first() else {
            return s;
        };
        for (i, row) in first.results.iter().enumerate() {
            let rows: Vec<Option<&Row>> = self.paths.iter().map(|p| p.results.get(i)).collect();
            let bounds: Vec<String> = rows.iter().flatten().map(|r| bound_name(r)).collect();
            let bound = if bounds.iter().all(|b| *b == bounds[0]) {
                bounds[0].clone()
            } else {
                bounds.join(" / ")
            };
            let _ = write!(s, "| {} | {} | {bound} |", row.op, row.config);
            for r in &rows {
                match r {
                    Some(r) => {
                        let _ = write!(s, " {} | {:.3} |", fmt_time(r.time_s), r.fraction);
                    }
                    None => {
                        let _ = write!(s, " - | - |");
                    }
                }
            }
            if let Some(Some(base)) = rows.last() {
                for r in &rows[..rows.len() - 1] {
                    match r {
                        Some(r) => {
                            let _ = write!(s, " {:.2}× |", base.time_s / r.time_s);
                        }
                        None => {
                            let _ = write!(s, " - |");
                        }
                    }
                }
            }
            let _ = writeln!(s);
        }
        s
    }
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "tests: a failure panics with its message"
)]
mod tests {
    use super::*;
    use crate::Scale;

    /// Two paths (or the one there is) side by side on the smoke shapes of one op: a row
    /// per case on each, read against each path's own peak.
    #[test]
    fn paths_side_by_side() {
        let mut suite = Suite::new(Scale::Smoke).unwrap();
        suite.indexer_logits.truncate(1);
        suite.topk.clear();
        suite.sparse_mla.truncate(1);
        suite.sparse_mla_v4.clear();
        suite.stores.truncate(1);
        suite.copies.clear();
        suite.checksums.clear();
        suite.matmuls.truncate(1);
        let isas: Vec<CpuIsa> = CpuIsa::available().into_iter().take(2).collect();
        let opts = RunOptions {
            warmup: 0,
            samples: 1,
        };
        let rep = run_paths(&isas, &suite, Effort::Quick, opts, 2, |_| {}).unwrap();
        assert_eq!(rep.paths.len(), isas.len());
        for p in &rep.paths {
            assert_eq!(p.results.len(), 4);
            assert!(p.results.iter().all(|r| r.samples == 2));
        }
        let t = rep.table();
        assert!(t.contains("| indexer_logits |"), "{t}");
        assert!(t.contains("| dense_matmul |"), "{t}");
    }
}
