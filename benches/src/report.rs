//! Reading measured times against the roofline: the summary table and its JSON.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::cost::Cost;
use crate::roofline::Roofline;

/// Which ceiling bounds an op on this machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Bound {
    Compute,
    Memory,
}

impl Bound {
    pub fn name(&self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::Memory => "memory",
        }
    }

    /// The bound that applies to `cost` here: the larger of `bytes / bandwidth` and
    /// `flops / peak` (the peak of [`Roofline::compute_peak`]), and that time.
    pub fn of(cost: Cost, roof: &Roofline) -> (Bound, f64) {
        let t_mem = cost.bytes as f64 / roof.copy_bytes_per_s;
        let t_flop = cost.flops as f64 / roof.compute_peak(&cost).0;
        if t_flop >= t_mem {
            (Bound::Compute, t_flop)
        } else {
            (Bound::Memory, t_mem)
        }
    }
}

/// One bench result read against the roofline.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub op: String,
    pub config: String,
    /// Median time per call over the measured samples, seconds.
    pub time_s: f64,
    /// Fastest sample, seconds per call.
    pub min_time_s: f64,
    pub samples: usize,
    pub bytes: u64,
    pub flops: u64,
    /// `bytes / time_s`.
    pub bytes_per_s: f64,
    /// `flops / time_s`.
    pub flops_per_s: f64,
    pub bound: Bound,
    /// The ceiling of the bound: `copy`, `f32 FMA` or `bf16 dot`.
    pub peak: &'static str,
    /// Time the op would take at the bound.
    pub roofline_time_s: f64,
    /// `roofline_time_s / time_s`: 1.0 = at the roofline.
    pub fraction: f64,
    /// `roofline_time_s / min_time_s`: the same for the fastest sample (less sensitive to
    /// other load on a shared machine; the ceilings are best-of measurements too).
    pub fraction_best: f64,
}

impl Row {
    /// Reads per-call times (seconds, one per sample) against `roof`; `None` without samples.
    pub fn new(
        op: &str,
        config: &str,
        cost: Cost,
        per_call_s: &[f64],
        roof: &Roofline,
    ) -> Option<Row> {
        let mut t: Vec<f64> = per_call_s
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .collect();
        if t.is_empty() {
            return None;
        }
        t.sort_by(f64::total_cmp);
        let n = t.len();
        let median = if n % 2 == 1 {
            t[n / 2]
        } else {
            0.5 * (t[n / 2 - 1] + t[n / 2])
        };
        let (bound, roofline_time_s) = Bound::of(cost, roof);
        let peak = match bound {
            Bound::Compute => roof.compute_peak(&cost).1,
            Bound::Memory => "copy",
        };
        Some(Row {
            op: op.to_string(),
            config: config.to_string(),
            time_s: median,
            min_time_s: t[0],
            samples: n,
            bytes: cost.bytes,
            flops: cost.flops,
            bytes_per_s: cost.bytes as f64 / median,
            flops_per_s: cost.flops as f64 / median,
            bound,
            peak,
            roofline_time_s,
            fraction: roofline_time_s / median,
            fraction_best: roofline_time_s / t[0],
        })
    }
}

/// The machine the numbers come from.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    pub cpu: String,
    pub logical_cpus: usize,
    pub rayon_threads: usize,
}

impl Machine {
    pub fn detect() -> Machine {
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "unknown".to_string());
        Machine {
            cpu,
            logical_cpus: std::thread::available_parallelism().map_or(1, |n| n.get()),
            rayon_threads: rayon::current_num_threads(),
        }
    }
}

/// Everything one bench run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// UTC date of the run, `YYYY-MM-DD`.
    pub date: String,
    pub machine: Machine,
    /// The ceilings the results are read against: the best of `roofline_runs`.
    pub roofline: Roofline,
    /// Every roofline measurement of the run (before and after the op benches).
    pub roofline_runs: Vec<Roofline>,
    pub results: Vec<Row>,
}

/// Today's UTC date as `YYYY-MM-DD`.
pub fn utc_date() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// A duration for a table: `s`, `ms` or `µs`.
pub fn fmt_time(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

impl Report {
    /// A Markdown table (also readable as plain text).
    pub fn table(&self) -> String {
        let r = &self.roofline;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "machine: {} ({} logical CPUs, {} rayon threads), {}",
            self.machine.cpu, self.machine.logical_cpus, self.machine.rayon_threads, self.date
        );
        let _ = writeln!(
            s,
            "roofline: copy bandwidth {:.1} GB/s (read+write, {} MiB buffers), f32 FMA peak {:.1} GFLOP/s ({}){}",
            r.copy_bytes_per_s / 1e9,
            r.copy_buffer_bytes >> 20,
            r.fma_flops_per_s / 1e9,
            r.fma_isa,
            if r.bf16_dot_flops_per_s > 0.0 {
                format!(
                    ", bf16 dot-product peak {:.1} GFLOP/s (vdpbf16ps: the bound of the bf16 dot products)",
                    r.bf16_dot_flops_per_s / 1e9
                )
            } else if r.tile_flops_per_s > 0.0 {
                format!(
                    ", AMX tile peak {:.1} GFLOP/s (tdpbf16ps: the bound of the indexer's scores)",
                    r.tile_flops_per_s / 1e9
                )
            } else {
                String::new()
            }
        );
        if self.roofline_runs.len() > 1 {
            let runs: Vec<String> = self
                .roofline_runs
                .iter()
                .map(|r| {
                    format!(
                        "{:.1} GB/s, {:.1} GFLOP/s",
                        r.copy_bytes_per_s / 1e9,
                        r.fma_flops_per_s / 1e9
                    )
                })
                .collect();
            let _ = writeln!(
                s,
                "(best of {} measurements: {})",
                runs.len(),
                runs.join("; ")
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "| op | config | time (median) | min | GB/s | GFLOP/s | bound | roofline time | fraction of roofline | fraction (min) |"
        );
        let _ = writeln!(s, "|---|---|---:|---:|---:|---:|---|---:|---:|---:|");
        for row in &self.results {
            let _ = writeln!(
                s,
                "| {} | {} | {} | {} | {:.2} | {:.1} | {} | {} | {:.3} | {:.3} |",
                row.op,
                row.config,
                fmt_time(row.time_s),
                fmt_time(row.min_time_s),
                row.bytes_per_s / 1e9,
                row.flops_per_s / 1e9,
                bound_name(row),
                fmt_time(row.roofline_time_s),
                row.fraction,
                row.fraction_best
            );
        }
        s
    }

    /// Writes the report as pretty JSON to `path`, creating its folder.
    pub fn write_json(&self, path: &Path) -> std::io::Result<()> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let json = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        std::fs::write(path, json + "\n")
    }
}

/// `memory`, `compute` (f32 FMA) or `compute (bf16 dot)`.
pub fn bound_name(row: &Row) -> String {
    match (row.bound, row.peak) {
        (Bound::Compute, "bf16 dot") => "compute (bf16 dot)".to_string(),
        (Bound::Compute, "AMX tiles") => "compute (AMX tiles)".to_string(),
        (b, _) => b.name().to_string(),
    }
}

/// Criterion's output folder as criterion finds it: `$CRITERION_HOME`, else
/// `$CARGO_TARGET_DIR/criterion`, else `<target>/criterion` next to this executable
/// (`<target>/<profile>/deps/<exe>`), else `target/criterion`.
pub fn criterion_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("CRITERION_HOME") {
        return PathBuf::from(home);
    }
    if let Some(t) = std::env::var_os("CARGO_TARGET_DIR") {
        return PathBuf::from(t).join("criterion");
    }
    std::env::current_exe()
        .ok()
        .and_then(|exe| {
            let deps = exe.parent()?;
            (deps.file_name()? == "deps").then(|| deps.parent()?.parent().map(Path::to_path_buf))?
        })
        .map_or_else(
            || PathBuf::from("target/criterion"),
            |t| t.join("criterion"),
        )
}

#[cfg(test)]
#[allow(
    clippy::unwrap_used,
    reason = "tests: a failure panics with its message"
)]
mod tests {
    use super::*;

    fn roof() -> Roofline {
        Roofline {
            copy_bytes_per_s: 10e9,
            copy_buffer_bytes: 1 << 28,
            fma_flops_per_s: 100e9,
            fma_isa: "test",
            bf16_dot_flops_per_s: 0.0,
            tile_flops_per_s: 0.0,
            threads: 2,
        }
    }

    #[test]
    fn bound_and_fraction() {
        let c = Cost {
            bytes: 1_000_000_000,
            flops: 200_000_000_000,
            bf16_dot: false,
            tiles: false,
        };
        // 2 s of compute vs 0.1 s of memory: compute-bound; measured median 4 s.
        let row = Row::new("op", "cfg", c, &[5.0, 4.0, 3.0], &roof()).unwrap();
        assert_eq!(row.bound, Bound::Compute);
        assert_eq!(row.time_s, 4.0);
        assert_eq!(row.min_time_s, 3.0);
        assert!((row.fraction - 0.5).abs() < 1e-12);
        assert!((row.fraction_best - 2.0 / 3.0).abs() < 1e-12);
        assert!((row.flops_per_s - 50e9).abs() < 1.0);
        let m = Cost {
            bytes: 10_000_000_000,
            flops: 0,
            bf16_dot: false,
            tiles: false,
        };
        let row = Row::new("op", "cfg", m, &[2.0, 2.0], &roof()).unwrap();
        assert_eq!(row.bound, Bound::Memory);
        assert!((row.fraction - 0.5).abs() < 1e-12);
        assert!(Row::new("op", "cfg", m, &[], &roof()).is_none());
        // bf16 dot products go against the bf16 peak where there is one.
        let dot = Cost {
            bf16_dot: true,
            tiles: false,
            ..c
        };
        let with_dot = Roofline {
            bf16_dot_flops_per_s: 400e9,
            tile_flops_per_s: 0.0,
            ..roof()
        };
        let r = Row::new("op", "cfg", dot, &[4.0], &with_dot).unwrap();
        assert_eq!((r.peak, r.roofline_time_s), ("bf16 dot", 0.5));
        let r = Row::new("op", "cfg", dot, &[4.0], &roof()).unwrap();
        assert_eq!((r.peak, r.roofline_time_s), ("f32 FMA", 2.0));
        let rep = Report {
            date: utc_date(),
            machine: Machine::detect(),
            roofline: roof(),
            roofline_runs: vec![roof()],
            results: vec![row],
        };
        assert!(rep.table().contains("| op | cfg |"));
    }

    #[test]
    fn dates() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(19_782), (2024, 2, 29));
        assert_eq!(civil_from_days(-1), (1969, 12, 31));
        assert_eq!(utc_date().len(), 10);
    }
}
