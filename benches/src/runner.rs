//! A plain timing runner over every bench configuration for any backend (what
//! `sparsekit bench --backend B` uses; `cargo bench` uses criterion over the same cases).
//!
//! Each case is built once, warmed up, then timed call by call; each timed call includes
//! `Backend::synchronize`, so a backend that enqueues its work (cuda) is timed until the
//! work has completed.

use std::time::Instant;

use sparsekit_host::{Backend, Error, ModelOps, Result};

use crate::cost::Cost;
use crate::dense::MatmulCase;
use crate::inputs::{IndexerLogitsCase, SparseMlaCase, TopkCase};
use crate::inputs_v4::SparseMlaV4Case;
use crate::pages::{ChecksumCase, CopyCase, Direction, StoreCase};
use crate::report::Row;
use crate::roofline::Roofline;
use crate::{indexer_logits_id, sparse_mla_id, topk_id, Suite};

/// How much to time.
#[derive(Clone, Copy, Debug)]
pub struct RunOptions {
    /// Untimed calls first.
    pub warmup: usize,
    /// Timed calls (at least one).
    pub samples: usize,
}

/// What one run produced.
#[derive(Debug, Default)]
pub struct RunOutput {
    /// Per-call samples of every timed case: (op, config, cost, seconds per call).
    pub timed: Vec<(String, String, Cost, Vec<f64>)>,
}

impl RunOutput {
    /// The timed cases read against `roof`.
    pub fn rows(&self, roof: &Roofline) -> Vec<Row> {
        self.timed
            .iter()
            .filter_map(|(op, cfg, cost, t)| Row::new(op, cfg, *cost, t, roof))
            .collect()
    }
}

fn time<B: Backend, C>(
    backend: &B,
    opts: RunOptions,
    build: impl FnOnce() -> Result<C>,
    mut run: impl FnMut(&mut C, &B) -> Result<()>,
) -> Result<Vec<f64>> {
    let mut t = time_side_by_side(std::slice::from_ref(backend), opts, 1, build, &mut run)?;
    Ok(t.pop().unwrap_or_default())
}

/// Calls shorter than this (seconds) get one untimed call at the start of each of their
/// backend's turns (see [`time_side_by_side`]); longer ones do not need it, and it would
/// make the run much longer.
const REWARM_BELOW_S: f64 = 0.05;

/// Builds a case once (with `backends[0]`: the inputs are buffers every backend of the
/// slice reads) and times it on each backend in alternation: warm-up calls on each, then
/// `rounds` rounds of `opts.samples` calls per backend, so that every backend sees the
/// same load; with several backends, each turn of a backend whose calls are short starts
/// with one untimed call, as the first turn starts after its warm-up. Per backend, every
/// per-call time in round order.
fn time_side_by_side<B: Backend, C>(
    backends: &[B],
    opts: RunOptions,
    rounds: usize,
    build: impl FnOnce() -> Result<C>,
    run: &mut impl FnMut(&mut C, &B) -> Result<()>,
) -> Result<Vec<Vec<f64>>> {
    let mut case = build()?;
    // Per backend: whether its calls are short enough that the first one after another
    // backend's turn is not representative (caches and TLB hold the other path's data,
    // the worker threads have gone to sleep) and is rerun untimed each round.
    let mut rewarm = Vec::with_capacity(backends.len());
    for b in backends {
        let start = Instant::now();
        for _ in 0..opts.warmup {
            run(&mut case, b)?;
        }
        b.synchronize()?;
        let per_call = start.elapsed().as_secs_f64() / opts.warmup.max(1) as f64;
        rewarm.push(backends.len() > 1 && opts.warmup > 0 && per_call < REWARM_BELOW_S);
    }
    let mut t = vec![Vec::with_capacity(opts.samples.max(1) * rounds.max(1)); backends.len()];
    for _ in 0..rounds.max(1) {
        for ((b, t), &rewarm) in backends.iter().zip(&mut t).zip(&rewarm) {
            if rewarm {
                run(&mut case, b)?;
                b.synchronize()?;
            }
            for _ in 0..opts.samples.max(1) {
                let start = Instant::now();
                run(&mut case, b)?;
                b.synchronize()?;
                t.push(start.elapsed().as_secs_f64());
            }
        }
    }
    Ok(t)
}

/// Runs every case of `suite` on `backend`; `progress` is called with each case's
/// `op/config` before it runs.
pub fn run<B: ModelOps>(
    backend: &B,
    suite: &Suite,
    opts: RunOptions,
    progress: impl FnMut(&str),
) -> Result<RunOutput> {
    let mut out = run_side_by_side(std::slice::from_ref(backend), suite, opts, 1, progress)?;
    Ok(out.pop().unwrap_or_default())
}

/// Runs every case of `suite` on each of `backends` side by side (e.g. the CPU backend on
/// each of its vector paths): each case is built once and timed on every backend in
/// alternation, `rounds` rounds (see `time_side_by_side`). One output per backend, in
/// order; `progress` is called with each case's `op/config` before it runs.
pub fn run_side_by_side<B: ModelOps>(
    backends: &[B],
    suite: &Suite,
    opts: RunOptions,
    rounds: usize,
    mut progress: impl FnMut(&str),
) -> Result<Vec<RunOutput>> {
    let mut out: Vec<RunOutput> = backends.iter().map(|_| RunOutput::default()).collect();
    let Some(first) = backends.first() else {
        return Ok(out);
    };
    let mut add = |op: &str,
                   cfg: String,
                   cost: Cost,
                   f: &mut dyn FnMut() -> Result<Vec<Vec<f64>>>|
     -> Result<()> {
        let name = format!("{op}/{cfg}");
        progress(&name);
        for (o, t) in out.iter_mut().zip(f()?) {
            o.timed.push((op.to_string(), cfg.clone(), cost, t));
        }
        Ok(())
    };
    macro_rules! side_by_side {
        ($build:expr, $run:expr) => {
            time_side_by_side(backends, opts, rounds, $build, &mut $run)
        };
    }
    for (i, s) in suite.indexer_logits.iter().enumerate() {
        add(
            "indexer_logits",
            indexer_logits_id(s),
            s.cost()?,
            &mut || {
                side_by_side!(
                    || IndexerLogitsCase::build(first, *s, 100 + i as u64),
                    |c: &mut IndexerLogitsCase<B>, b: &B| c.run(b)
                )
            },
        )?;
    }
    for (i, s) in suite.topk.iter().enumerate() {
        add("topk", topk_id(s), s.cost()?, &mut || {
            side_by_side!(
                || TopkCase::build(first, *s, 200 + i as u64),
                |c: &mut TopkCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.sparse_mla.iter().enumerate() {
        add("sparse_mla", sparse_mla_id(s), s.cost(), &mut || {
            side_by_side!(
                || SparseMlaCase::build(first, *s, 300 + i as u64),
                |c: &mut SparseMlaCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.sparse_mla_v4.iter().enumerate() {
        add("sparse_mla_v4", s.id(), s.cost(), &mut || {
            side_by_side!(
                || SparseMlaV4Case::build(first, *s, 350 + i as u64),
                |c: &mut SparseMlaV4Case<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.stores.iter().enumerate() {
        let (op, cfg) = s.id();
        add(&op, cfg, s.cost(), &mut || {
            side_by_side!(
                || StoreCase::build(first, *s, 400 + i as u64),
                |c: &mut StoreCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.copies.iter().enumerate() {
        add("copy_pages", s.id(), s.cost(), &mut || {
            side_by_side!(
                || CopyCase::build(first, *s, 500 + i as u64),
                |c: &mut CopyCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.checksums.iter().enumerate() {
        add("page_checksums", s.id(), s.cost(), &mut || {
            side_by_side!(
                || ChecksumCase::build(first, *s, 600 + i as u64),
                |c: &mut ChecksumCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    for (i, s) in suite.matmuls.iter().enumerate() {
        add("dense_matmul", s.id(), s.cost(), &mut || {
            side_by_side!(
                || MatmulCase::build(first, *s, 700 + i as u64),
                |c: &mut MatmulCase<B>, b: &B| c.run(b)
            )
        })?;
    }
    Ok(out)
}

/// The copy ceiling of a backend that is not this CPU: the best rate of the backend's own
/// device-to-device page copy over the largest copy shape of `suite` (bytes read +
/// written per second). Compute ceilings are not measured for such backends.
pub fn backend_copy_roofline<B: Backend>(backend: &B, suite: &Suite) -> Result<Roofline> {
    let shape = suite
        .copies
        .iter()
        .filter(|s| s.direction == Direction::DeviceToDevice)
        .max_by_key(|s| s.cost().bytes)
        .copied()
        .ok_or_else(|| Error::InvalidArgument {
            what: "suite",
            detail: "no device-to-device copy to measure the copy ceiling with".into(),
        })?;
    let t = time(
        backend,
        RunOptions {
            warmup: 2,
            samples: 5,
        },
        || CopyCase::build(backend, shape, 7),
        |c, b| c.run(b),
    )?;
    let best = t.iter().copied().fold(f64::INFINITY, f64::min);
    Ok(Roofline {
        copy_bytes_per_s: shape.cost().bytes as f64 / best,
        copy_buffer_bytes: shape.cost().bytes as usize / 2,
        fma_flops_per_s: f64::INFINITY,
        fma_isa: "not measured",
        bf16_dot_flops_per_s: 0.0,
        tile_flops_per_s: 0.0,
        threads: 0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use sparsekit_host::CpuBackend;

    /// Side by side, each turn of a backend with short calls starts with one untimed
    /// call; alone, a backend gets none (its calls follow each other already).
    #[test]
    fn short_calls_are_rewarmed_at_each_turn_side_by_side() {
        let cpu = CpuBackend::new();
        let opts = RunOptions {
            warmup: 1,
            samples: 2,
        };
        let pair = [cpu.clone(), cpu];
        let mut seen = [0usize; 2];
        let t = time_side_by_side(&pair, opts, 3, || Ok(()), &mut |_, b| {
            seen[usize::from(!std::ptr::eq(b, &pair[0]))] += 1;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        // Timed calls only in the output.
        assert_eq!(t.iter().map(Vec::len).collect::<Vec<_>>(), [6, 6]);
        // 1 warm-up + 3 turns × (1 untimed + 2 timed).
        assert_eq!(seen, [10, 10]);
        let mut alone = 0usize;
        time_side_by_side(&pair[..1], opts, 3, || Ok(()), &mut |_, _| {
            alone += 1;
            Ok(())
        })
        .unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(alone, 1 + 3 * 2);
    }
}
