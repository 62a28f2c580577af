//! The evidence table: one row per harness configuration (and round), printed for people
//! or as JSON (`--json`) with the fields of issue 10 — `config`, `index_k`, `host_tier`,
//! `pd`, `sessions`, `corrupted`, `corrupted_pct`, `refused`, `wedged`, `leaked_pages`,
//! `refused_frames`, `ttft_p50_ms`, `ttft_p99_ms`, `health_p99_ms`, `host_hit_rate`,
//! `ttft_speedup_turn3plus` — plus the round, what the checks detected, aborted sessions,
//! quarantined pages, the device hit rate, TTFT by turn, the injection and its verdict.
//!
//! A measure that a configuration cannot have (no host tier → no host hit rate, no PD →
//! no refused frames) or that was not measured is `null` in JSON and `-` in the table,
//! never a made-up zero. A configuration that cannot run is a row with `available: false`
//! and a note saying why, and no numbers at all.

use serde::Serialize;

use crate::harness::compare::Tally;
use crate::harness::config::{index_k_name, ConfigKey, Injection};
use crate::harness::run::SessionTrace;

/// Which configuration a row describes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ConfigLabel {
    pub config: String,
    pub index_k: String,
    /// `on`, `off`.
    pub host_tier: String,
    /// `on`, `off`.
    pub pd: String,
}

impl ConfigLabel {
    /// A label from its four parts.
    pub fn new(config: &str, index_k: &str, host_tier: &str, pd: &str) -> Self {
        ConfigLabel {
            config: config.into(),
            index_k: index_k.into(),
            host_tier: host_tier.into(),
            pd: pd.into(),
        }
    }

    /// The label of an evidence configuration.
    pub fn of(c: &ConfigKey) -> Self {
        ConfigLabel::new(
            &c.name(),
            index_k_name(c.index_k),
            c.host_tier_label(),
            c.pd_label(),
        )
    }
}

/// What an injection did to a row's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// Checks on: the injection was detected and nothing was corrupted.
    Caught,
    /// Checks off: the injection corrupted sessions (the historical bug reproduced).
    Reproduced,
    /// Neither detected nor corrupting: the injection did not bite (a harness defect).
    Silent,
    /// Checks on and still corrupted sessions.
    Escaped,
    /// The injection cannot bite this configuration (it must stay clean).
    NotAffected,
}

impl Verdict {
    /// The verdict of an injection on a measured row. With the checks on it is caught when
    /// the checks counted it and, where the checks can keep sessions right (every cache
    /// check; not a kernel bug, which can only be detected), nothing was corrupted — without
    /// a reference (`--no-reference`) the checks' counts alone decide, as in production.
    /// With the checks off it is reproduced when sessions were corrupted.
    pub fn judge(inj: Injection, c: &ConfigKey, verify: bool, row: &EvidenceRow) -> Verdict {
        let corrupted = row.corrupted.unwrap_or(0);
        let detected = row.detected.unwrap_or(0) + row.refused.unwrap_or(0) as u64;
        match (inj.affects(c), verify) {
            (false, _) => Verdict::NotAffected,
            (true, true) if corrupted > 0 && inj.preventable() => Verdict::Escaped,
            (true, true) if detected > 0 => Verdict::Caught,
            (true, true) if corrupted > 0 => Verdict::Escaped,
            (true, false) if corrupted > 0 => Verdict::Reproduced,
            _ => Verdict::Silent,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Verdict::Caught => "caught",
            Verdict::Reproduced => "reproduced",
            Verdict::Silent => "SILENT",
            Verdict::Escaped => "ESCAPED",
            Verdict::NotAffected => "n/a",
        }
    }

    /// Whether the verdict is what the evidence needs (caught with checks on, reproduced
    /// with them off, or an unaffected configuration that stayed clean).
    pub fn is_expected(&self, row: &EvidenceRow) -> bool {
        match self {
            Verdict::Caught | Verdict::Reproduced => true,
            Verdict::NotAffected => row.corrupted.unwrap_or(0) == 0,
            Verdict::Silent | Verdict::Escaped => false,
        }
    }
}

/// The whole output of one `sparsekit repro` run, as `--json` prints it and `--report`
/// stores it (`docs/repro.md` documents every field).
#[derive(Clone, Debug, Serialize)]
pub struct RunReport {
    /// Version of this schema: a consumer checks it before reading the rest.
    pub schema_version: u32,
    /// The command line that produced it.
    pub command: String,
    /// Wall time of the whole run (references, every configuration and round).
    pub wall_seconds: f64,
    pub sessions: usize,
    pub turns: usize,
    pub rounds: usize,
    pub backend: String,
    pub model: String,
    /// Pool sizes in pages (`None` against running servers: theirs).
    pub sizing: Option<crate::harness::deploy::Sizing>,
    /// Whether sessions were compared with an uncached reference run.
    pub reference: bool,
    pub injection: Option<String>,
    pub verify: bool,
    pub rows: Vec<EvidenceRow>,
}

/// The current [`RunReport::schema_version`].
pub const REPORT_SCHEMA_VERSION: u32 = 3;

/// How many integrity events one check counted over a row's run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct CheckCount {
    /// `family:label`, e.g. `checksum:host_load`, `refused:unwritten`,
    /// `detection:landing_wait`, `kernel:topk`, `frame:fingerprint`, `fallback:checksum`.
    pub check: String,
    pub count: u64,
}

/// TTFT of one turn (1-based) over a row's sessions.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct TurnTtft {
    pub turn: usize,
    pub p50_ms: Option<f64>,
    pub p99_ms: Option<f64>,
}

/// Where a corrupted session first diverged from the reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Divergence {
    pub session: usize,
    pub turn: usize,
    pub step: usize,
}

/// One row of the evidence table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvidenceRow {
    /// The configuration (with several models in one run: `MODEL/config` for all rows).
    pub config: String,
    /// The model config served (`tiny`, `dsv4-tiny`, …).
    pub model: String,
    pub index_k: String,
    /// `on`, `off`.
    pub host_tier: String,
    /// `on`, `off`.
    pub pd: String,
    /// Round (1-based) when the run had several.
    pub round: Option<usize>,
    /// Whether this configuration ran.
    pub available: bool,
    /// Why not, or what the row covers.
    pub note: Option<String>,
    /// The fault injected (`--inject`) and whether the checks were on.
    pub injection: Option<String>,
    pub verify: bool,
    pub sessions: Option<usize>,
    pub corrupted: Option<usize>,
    pub corrupted_pct: Option<f64>,
    /// Sessions stopped by a refused request (a check failed it cleanly).
    pub refused: Option<usize>,
    /// Integrity events the checks counted (`sparsekit_refused_total`,
    /// `sparsekit_checksum_failures_total`, `sparsekit_integrity_detections_total` and
    /// kernel-check mismatches over the run).
    pub detected: Option<u64>,
    /// Which checks counted them: `check:detail` (e.g. `checksum:host_load`,
    /// `refused:unwritten`, `detection:landing_wait`, `kernel:topk`, `frame:fingerprint`)
    /// with the count, nonzero only.
    pub caught_by: Vec<CheckCount>,
    /// Requests served by recomputing a prefix that failed a check.
    pub fallbacks: Option<u64>,
    /// Kernel calls re-checked against the f64 references, and how many differed.
    pub kernel_checks: Option<u64>,
    pub kernel_mismatches: Option<u64>,
    /// Whether sessions were compared with the uncached reference (`false` for
    /// `--no-reference`: `corrupted` is then unknown).
    pub reference: bool,
    /// Sessions stopped by a client abort (`--abort-rate`).
    pub aborted: Option<usize>,
    /// Sessions stopped by a request past its deadline, plus failed `/health` probes.
    pub wedged: Option<usize>,
    pub leaked_pages: Option<usize>,
    pub quarantined_pages: Option<usize>,
    pub refused_frames: Option<u64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    /// TTFT p50 of turns 3 and later (the speed-up's measure).
    pub ttft_turn3plus_p50_ms: Option<f64>,
    pub health_p99_ms: Option<f64>,
    /// Prompt pages served from the host tier / device tier, of those looked up.
    pub host_hit_rate: Option<f64>,
    pub device_hit_rate: Option<f64>,
    /// TTFT p50 at turns ≥ 3 of the same configuration with the host tier off, divided by
    /// this row's (host tier on rows only).
    pub ttft_speedup_turn3plus: Option<f64>,
    /// TTFT p50 and p99 (ms) per turn, turn 1 first.
    pub ttft_by_turn_ms: Vec<TurnTtft>,
    /// The first divergence of each corrupted session.
    pub first_divergences: Vec<Divergence>,
    /// What the injection did here (with `--inject`).
    pub verdict: Option<Verdict>,
}

impl EvidenceRow {
    /// A configuration that cannot run: no numbers, a note saying why.
    pub fn unavailable(label: &ConfigLabel, why: &str) -> Self {
        EvidenceRow {
            config: label.config.clone(),
            model: String::new(),
            index_k: label.index_k.clone(),
            host_tier: label.host_tier.clone(),
            pd: label.pd.clone(),
            round: None,
            available: false,
            note: Some(why.into()),
            injection: None,
            verify: true,
            sessions: None,
            corrupted: None,
            corrupted_pct: None,
            refused: None,
            detected: None,
            caught_by: Vec::new(),
            fallbacks: None,
            kernel_checks: None,
            kernel_mismatches: None,
            reference: true,
            aborted: None,
            wedged: None,
            leaked_pages: None,
            quarantined_pages: None,
            refused_frames: None,
            ttft_p50_ms: None,
            ttft_p99_ms: None,
            ttft_turn3plus_p50_ms: None,
            health_p99_ms: None,
            host_hit_rate: None,
            device_hit_rate: None,
            ttft_speedup_turn3plus: None,
            ttft_by_turn_ms: Vec::new(),
            first_divergences: Vec::new(),
            verdict: None,
        }
    }

    /// A row from a finished run: the tally, the served traces (for TTFT), `/health`
    /// latencies (seconds, `INFINITY` for a failed probe; empty when not probed) and the
    /// leaked pages (when counted).
    pub fn measured(
        label: &ConfigLabel,
        tally: &Tally,
        served: &[SessionTrace],
        health: &[f64],
        leaked_pages: Option<usize>,
    ) -> Self {
        let ttft_ms = |turns: &dyn Fn(usize) -> bool| -> Vec<f64> {
            served
                .iter()
                .flat_map(|s| s.turns.iter().enumerate())
                .filter(|(t, _)| turns(*t))
                .filter_map(|(_, t)| t.ttft.map(|x| x * 1e3))
                .collect()
        };
        let all = ttft_ms(&|_| true);
        let turns = served.iter().map(|s| s.turns.len()).max().unwrap_or(0);
        let by_turn = (0..turns)
            .map(|t| {
                let v = ttft_ms(&|x| x == t);
                TurnTtft {
                    turn: t + 1,
                    p50_ms: percentile(&v, 50.0),
                    p99_ms: percentile(&v, 99.0),
                }
            })
            .collect();
        let health_ms: Vec<f64> = health.iter().map(|x| x * 1e3).collect();
        let health_failures = health.iter().filter(|x| !x.is_finite()).count();
        EvidenceRow {
            available: true,
            note: None,
            sessions: Some(tally.sessions),
            corrupted: Some(tally.corrupted),
            corrupted_pct: Some(tally.corrupted_pct()),
            refused: Some(tally.refused),
            aborted: Some(tally.aborted),
            wedged: Some(tally.wedged + health_failures),
            leaked_pages,
            ttft_p50_ms: percentile(&all, 50.0),
            ttft_p99_ms: percentile(&all, 99.0),
            ttft_turn3plus_p50_ms: percentile(&ttft_ms(&|t| t >= 2), 50.0),
            health_p99_ms: percentile(&health_ms, 99.0),
            ttft_by_turn_ms: by_turn,
            first_divergences: tally
                .first_divergences
                .iter()
                .map(|&(session, turn, step)| Divergence {
                    session,
                    turn,
                    step,
                })
                .collect(),
            ..Self::unavailable(label, "")
        }
    }

    /// Whether the row shows a problem without an injection to explain it: corruption, a
    /// refused request or a detection, a wedge, a leak.
    pub fn is_clean(&self) -> bool {
        !self.available
            || (self.corrupted.unwrap_or(0) == 0
                && self.refused.unwrap_or(0) == 0
                && self.detected.unwrap_or(0) == 0
                && self.wedged.unwrap_or(0) == 0
                && self.leaked_pages.unwrap_or(0) == 0)
    }
}

/// The `p`-th percentile (nearest rank) of `v`; `None` for an empty sample.
pub fn percentile(v: &[f64], p: f64) -> Option<f64> {
    if v.is_empty() {
        return None;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = ((p / 100.0) * s.len() as f64).ceil().max(1.0) as usize;
    Some(s[rank.min(s.len()) - 1])
}

fn cell<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".to_string(), |x| x.to_string())
}

fn cell_f(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".to_string(), |x| format!("{x:.digits$}"))
}

/// Lays out `lines` (the first is the header) in aligned columns; a line shorter than
/// the header lets its last cell run on.
fn layout(lines: &[Vec<String>]) -> String {
    let cols = lines.first().map_or(0, Vec::len);
    let mut width = vec![0; cols];
    for l in lines {
        let shared = if l.len() == cols {
            cols
        } else {
            l.len().saturating_sub(1)
        };
        for (w, c) in width.iter_mut().zip(l).take(shared) {
            *w = (*w).max(c.chars().count());
        }
    }
    let mut out = String::new();
    for (i, l) in lines.iter().enumerate() {
        let cells: Vec<String> = l
            .iter()
            .enumerate()
            .map(|(j, c)| {
                if l.len() == cols || j + 1 < l.len() {
                    format!("{c:<w$}", w = width[j.min(cols - 1)])
                } else {
                    c.clone()
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
        if i == 0 {
            let total: usize = width.iter().sum::<usize>() + 2 * cols.saturating_sub(1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
        }
    }
    out
}

/// The tables for people, each narrow enough for a terminal: what the checks saw (one
/// line per row, unavailable rows with their note), then the serving numbers, then TTFT
/// by turn, then each row's notes.
pub fn render_table(rows: &[EvidenceRow]) -> String {
    let integrity = [
        "config",
        "round",
        "sessions",
        "corrupted",
        "refused",
        "detected",
        "fallbacks",
        "kernel chk",
        "aborted",
        "wedged",
        "leaked",
        "quarant.",
        "ref. frames",
        "verdict",
    ];
    let mut lines: Vec<Vec<String>> = vec![integrity.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        if !r.available {
            lines.push(vec![
                r.config.clone(),
                format!("unavailable: {}", r.note.clone().unwrap_or_default()),
            ]);
            continue;
        }
        let corrupted = match (r.corrupted, r.corrupted_pct) {
            (Some(c), Some(p)) => format!("{c} ({p:.1}%)"),
            _ if !r.reference => "no ref.".into(),
            _ => "-".into(),
        };
        lines.push(vec![
            r.config.clone(),
            cell(r.round),
            cell(r.sessions),
            corrupted,
            cell(r.refused),
            cell(r.detected),
            cell(r.fallbacks),
            match (r.kernel_checks, r.kernel_mismatches) {
                (Some(n), Some(0)) => format!("{n} ok"),
                (Some(n), Some(m)) => format!("{m}/{n} BAD"),
                _ => "-".into(),
            },
            cell(r.aborted),
            cell(r.wedged),
            cell(r.leaked_pages),
            cell(r.quarantined_pages),
            cell(r.refused_frames),
            r.verdict.map_or("-", |v| v.name()).to_string(),
        ]);
    }
    let mut out = layout(&lines);
    let serving = [
        "config",
        "round",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "health p99 ms",
        "dev hits %",
        "host hits %",
        "speed-up t3+",
    ];
    let mut lines: Vec<Vec<String>> = vec![serving.iter().map(|s| s.to_string()).collect()];
    for r in rows.iter().filter(|r| r.available) {
        lines.push(vec![
            r.config.clone(),
            cell(r.round),
            cell_f(r.ttft_p50_ms, 1),
            cell_f(r.ttft_p99_ms, 1),
            cell_f(r.health_p99_ms, 2),
            cell_f(r.device_hit_rate.map(|x| x * 100.0), 1),
            cell_f(r.host_hit_rate.map(|x| x * 100.0), 1),
            cell_f(r.ttft_speedup_turn3plus, 2),
        ]);
    }
    if lines.len() > 1 {
        out.push('\n');
        out.push_str(&layout(&lines));
    }
    let turns = rows
        .iter()
        .map(|r| r.ttft_by_turn_ms.len())
        .max()
        .unwrap_or(0);
    if turns > 0 {
        let mut header = vec!["TTFT p50/p99 ms by turn".to_string(), "round".to_string()];
        header.extend((1..=turns).map(|t| format!("turn {t}")));
        let mut lines = vec![header];
        for r in rows.iter().filter(|r| r.available) {
            let mut l = vec![r.config.clone(), cell(r.round)];
            l.extend((0..turns).map(|t| match r.ttft_by_turn_ms.get(t) {
                Some(x) => format!("{}/{}", cell_f(x.p50_ms, 0), cell_f(x.p99_ms, 0)),
                None => "-".into(),
            }));
            lines.push(l);
        }
        out.push('\n');
        out.push_str(&layout(&lines));
    }
    for r in rows.iter().filter(|r| r.available) {
        if let Some(n) = &r.note {
            out.push_str(&format!("{}: {n}\n", r.config));
        }
        if !r.caught_by.is_empty() {
            let by: Vec<String> = r
                .caught_by
                .iter()
                .map(|c| format!("{} {}", c.check, c.count))
                .collect();
            out.push_str(&format!("{}: caught by {}\n", r.config, by.join(", ")));
        }
        if !r.first_divergences.is_empty() {
            let d: Vec<String> = r
                .first_divergences
                .iter()
                .map(|d| format!("({}, {}, {})", d.session, d.turn, d.step))
                .collect();
            out.push_str(&format!(
                "{}: first divergences (session, turn, step): {}\n",
                r.config,
                d.join(", ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_and_rendering() {
        assert_eq!(percentile(&[], 50.0), None);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50.0), Some(2.0));
        let v: Vec<f64> = (1..=100).map(f64::from).collect();
        assert_eq!(percentile(&v, 99.0), Some(99.0));
        assert_eq!(percentile(&v, 100.0), Some(100.0));
        let tally = Tally {
            sessions: 4,
            clean: 3,
            corrupted: 1,
            first_divergences: vec![(2, 1, 5)],
            ..Default::default()
        };
        let row = EvidenceRow::measured(
            &ConfigLabel::new("fp8/host-off/pd-off", "fp8", "off", "off"),
            &tally,
            &[],
            &[0.002, f64::INFINITY],
            Some(0),
        );
        assert_eq!(row.wedged, Some(1), "a failed /health probe is a wedge");
        assert!(!row.is_clean());
        let na = EvidenceRow::unavailable(
            &ConfigLabel::new("fp8/host-on/pd-on", "fp8", "on", "on"),
            "needs PD transfer",
        );
        let text = render_table(&[row.clone(), na.clone()]);
        assert!(text.contains("1 (25.0%)"), "{text}");
        assert!(text.contains("unavailable: needs PD transfer"), "{text}");
        assert!(text.contains("(2, 1, 5)"), "{text}");
        let json = serde_json::to_value(&na).unwrap_or_default();
        assert!(json["corrupted"].is_null() && json["ttft_p99_ms"].is_null());
        let json = serde_json::to_value(&row).unwrap_or_default();
        assert_eq!(json["corrupted"], 1);
        assert!(json["host_hit_rate"].is_null(), "no host tier, no hit rate");
        assert_eq!(
            json["health_p99_ms"],
            serde_json::Value::Null,
            "inf is not JSON"
        );
    }

    #[test]
    fn verdicts() {
        let c = ConfigKey {
            index_k: sparsekit_host::IndexKDtype::Bf16,
            host_tier: true,
            pd: false,
            small_decode: false,
        };
        let mut r = EvidenceRow::unavailable(&ConfigLabel::of(&c), "");
        r.available = true;
        r.corrupted = Some(0);
        r.refused = Some(0);
        r.detected = Some(0);
        let inj = Injection::SharedItemSize;
        assert_eq!(Verdict::judge(inj, &c, true, &r), Verdict::Silent);
        assert_eq!(Verdict::judge(inj, &c, false, &r), Verdict::Silent);
        r.detected = Some(3);
        assert_eq!(Verdict::judge(inj, &c, true, &r), Verdict::Caught);
        r.corrupted = Some(2);
        assert_eq!(Verdict::judge(inj, &c, true, &r), Verdict::Escaped);
        assert_eq!(Verdict::judge(inj, &c, false, &r), Verdict::Reproduced);
        let off = c.without_host_tier();
        assert_eq!(Verdict::judge(inj, &off, true, &r), Verdict::NotAffected);
        assert!(
            !Verdict::NotAffected.is_expected(&r),
            "unaffected yet corrupted"
        );
        // A kernel bug cannot be kept out of the sessions, only detected.
        let k = Injection::KernelWrongSlot;
        assert_eq!(Verdict::judge(k, &c, true, &r), Verdict::Caught);
        r.detected = Some(0);
        assert_eq!(Verdict::judge(k, &c, true, &r), Verdict::Escaped);
        // Without a reference the checks' counts decide.
        r.corrupted = None;
        r.detected = Some(2);
        assert_eq!(Verdict::judge(inj, &c, true, &r), Verdict::Caught);
        r.detected = Some(0);
        assert_eq!(Verdict::judge(inj, &c, true, &r), Verdict::Silent);
    }
}
