//! A plain timing runner over every bench configuration for any backend (what
//! `sparsekit bench --backend B` uses; `cargo bench` uses criterion over the same cases).
//!
//! Each case is built once, warmed up, then timed call by call; each timed call includes
//! `Backend::synchronize`, so a backend that enqueues its work (cuda) is timed until the
//! work has completed.

use std::time::Instant;

use sparsekit_host::{Backend, Error, Result};

use crate::cost::Cost;
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
    let mut case = build()?;
    for _ in 0..opts.warmup {
        run(&mut case, backend)?;
    }
    backend.synchronize()?;
    let mut t = Vec::with_capacity(opts.samples.max(1));
    for _ in 0..opts.samples.max(1) {
        let start = Instant::now();
        run(&mut case, backend)?;
        backend.synchronize()?;
        t.push(start.elapsed().as_secs_f64());
    }
    Ok(t)
}

/// Runs every case of `suite` on `backend`; `progress` is called with each case's
/// `op/config` before it runs.
pub fn run<B: Backend>(
    backend: &B,
    suite: &Suite,
    opts: RunOptions,
    mut progress: impl FnMut(&str),
) -> Result<RunOutput> {
    let mut out = RunOutput::default();
    let mut add = |op: &str,
                   cfg: String,
                   cost: Cost,
                   f: &mut dyn FnMut() -> Result<Vec<f64>>|
     -> Result<()> {
        let name = format!("{op}/{cfg}");
        progress(&name);
        let t = f()?;
        out.timed.push((op.to_string(), cfg, cost, t));
        Ok(())
    };
    for (i, s) in suite.indexer_logits.iter().enumerate() {
        add(
            "indexer_logits",
            indexer_logits_id(s),
            s.cost()?,
            &mut || {
                time(
                    backend,
                    opts,
                    || IndexerLogitsCase::build(backend, *s, 100 + i as u64),
                    |c, b| c.run(b),
                )
            },
        )?;
    }
    for (i, s) in suite.topk.iter().enumerate() {
        add("topk", topk_id(s), s.cost()?, &mut || {
            time(
                backend,
                opts,
                || TopkCase::build(backend, *s, 200 + i as u64),
                |c, b| c.run(b),
            )
        })?;
    }
    for (i, s) in suite.sparse_mla.iter().enumerate() {
        add("sparse_mla", sparse_mla_id(s), s.cost(), &mut || {
            time(
                backend,
                opts,
                || SparseMlaCase::build(backend, *s, 300 + i as u64),
                |c, b| c.run(b),
            )
        })?;
    }
    for (i, s) in suite.sparse_mla_v4.iter().enumerate() {
        add("sparse_mla_v4", s.id(), s.cost(), &mut || {
            time(
                backend,
                opts,
                || SparseMlaV4Case::build(backend, *s, 350 + i as u64),
                |c, b| c.run(b),
            )
        })?;
    }
    for (i, s) in suite.stores.iter().enumerate() {
        let (op, cfg) = s.id();
        add(&op, cfg, s.cost(), &mut || {
            time(
                backend,
                opts,
                || StoreCase::build(backend, *s, 400 + i as u64),
                |c, b| c.run(b),
            )
        })?;
    }
    for (i, s) in suite.copies.iter().enumerate() {
        add("copy_pages", s.id(), s.cost(), &mut || {
            time(
                backend,
                opts,
                || CopyCase::build(backend, *s, 500 + i as u64),
                |c, b| c.run(b),
            )
        })?;
    }
    for (i, s) in suite.checksums.iter().enumerate() {
        add("page_checksums", s.id(), s.cost(), &mut || {
            time(
                backend,
                opts,
                || ChecksumCase::build(backend, *s, 600 + i as u64),
                |c, b| c.run(b),
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
        threads: 0,
    })
}
