//! The evidence table: one row per harness configuration, printed for people or as JSON
//! (`--json`) with the fields of issue 10: `config`, `index_k`, `host_tier`, `pd`,
//! `sessions`, `corrupted`, `corrupted_pct`, `refused`, `wedged`, `leaked_pages`,
//! `refused_frames`, `ttft_p50_ms`, `ttft_p99_ms`, `health_p99_ms`, `host_hit_rate`,
//! `ttft_speedup_turn3plus`.
//!
//! A measure that a configuration cannot have (no host tier → no host hit rate, no PD →
//! no refused frames) or that was not measured is `null` in JSON and `-` in the table,
//! never a made-up zero. A configuration that cannot run yet is a row with
//! `available: false` and a note saying why, and no numbers at all.

use serde::Serialize;

use crate::harness::compare::Tally;
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
}

/// One row of the evidence table.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct EvidenceRow {
    pub config: String,
    pub index_k: String,
    /// `on`, `off`.
    pub host_tier: String,
    /// `on`, `off`.
    pub pd: String,
    /// Whether this configuration ran.
    pub available: bool,
    /// Why not, or what the row covers.
    pub note: Option<String>,
    pub sessions: Option<usize>,
    pub corrupted: Option<usize>,
    pub corrupted_pct: Option<f64>,
    pub refused: Option<usize>,
    pub wedged: Option<usize>,
    pub leaked_pages: Option<usize>,
    pub refused_frames: Option<u64>,
    pub ttft_p50_ms: Option<f64>,
    pub ttft_p99_ms: Option<f64>,
    pub health_p99_ms: Option<f64>,
    pub host_hit_rate: Option<f64>,
    pub ttft_speedup_turn3plus: Option<f64>,
    /// TTFT p50 and p99 (ms) per turn, turn 1 first.
    pub ttft_by_turn_ms: Vec<(Option<f64>, Option<f64>)>,
    /// `(session, turn, step)` of the first divergence of each corrupted session.
    pub first_divergences: Vec<(usize, usize, usize)>,
}

impl EvidenceRow {
    /// A configuration that cannot run yet: no numbers, a note saying why.
    pub fn unavailable(label: &ConfigLabel, why: &str) -> Self {
        EvidenceRow {
            config: label.config.clone(),
            index_k: label.index_k.clone(),
            host_tier: label.host_tier.clone(),
            pd: label.pd.clone(),
            available: false,
            note: Some(why.into()),
            sessions: None,
            corrupted: None,
            corrupted_pct: None,
            refused: None,
            wedged: None,
            leaked_pages: None,
            refused_frames: None,
            ttft_p50_ms: None,
            ttft_p99_ms: None,
            health_p99_ms: None,
            host_hit_rate: None,
            ttft_speedup_turn3plus: None,
            ttft_by_turn_ms: Vec::new(),
            first_divergences: Vec::new(),
        }
    }

    /// A row from a finished run: the tally, the served traces (for TTFT), `/health`
    /// latencies (seconds; empty when not probed) and the leaked pages (when counted).
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
                (percentile(&v, 50.0), percentile(&v, 99.0))
            })
            .collect();
        let health_ms: Vec<f64> = health.iter().map(|x| x * 1e3).collect();
        EvidenceRow {
            available: true,
            note: None,
            sessions: Some(tally.sessions),
            corrupted: Some(tally.corrupted),
            corrupted_pct: Some(tally.corrupted_pct()),
            refused: Some(tally.refused),
            wedged: Some(tally.wedged),
            leaked_pages,
            ttft_p50_ms: percentile(&all, 50.0),
            ttft_p99_ms: percentile(&all, 99.0),
            health_p99_ms: percentile(&health_ms, 99.0),
            ttft_by_turn_ms: by_turn,
            first_divergences: tally.first_divergences.clone(),
            ..Self::unavailable(label, "")
        }
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

/// The table for people: one line per row, unavailable rows with their note.
pub fn render_table(rows: &[EvidenceRow]) -> String {
    let header = [
        "config",
        "index-K",
        "host tier",
        "PD",
        "sessions",
        "corrupted",
        "refused",
        "wedged",
        "leaked pages",
        "refused frames",
        "TTFT p50 ms",
        "TTFT p99 ms",
        "health p99 ms",
        "host hits",
        "speed-up t3+",
    ];
    let mut lines: Vec<Vec<String>> = vec![header.iter().map(|s| s.to_string()).collect()];
    for r in rows {
        let corrupted = match (r.corrupted, r.corrupted_pct) {
            (Some(c), Some(p)) => format!("{c} ({p:.1}%)"),
            _ => "-".into(),
        };
        if !r.available {
            lines.push(vec![
                r.config.clone(),
                r.index_k.clone(),
                r.host_tier.clone(),
                r.pd.clone(),
                format!("unavailable: {}", r.note.clone().unwrap_or_default()),
            ]);
            continue;
        }
        lines.push(vec![
            r.config.clone(),
            r.index_k.clone(),
            r.host_tier.clone(),
            r.pd.clone(),
            cell(r.sessions),
            corrupted,
            cell(r.refused),
            cell(r.wedged),
            cell(r.leaked_pages),
            cell(r.refused_frames),
            cell_f(r.ttft_p50_ms, 1),
            cell_f(r.ttft_p99_ms, 1),
            cell_f(r.health_p99_ms, 2),
            cell_f(r.host_hit_rate.map(|x| x * 100.0), 1),
            cell_f(r.ttft_speedup_turn3plus, 2),
        ]);
    }
    let cols = header.len();
    let mut width = vec![0; cols];
    for l in &lines {
        // Unavailable rows share the first four columns; their note spans the rest.
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
            let total: usize = width.iter().sum::<usize>() + 2 * (cols - 1);
            out.push_str(&"-".repeat(total));
            out.push('\n');
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
            &ConfigLabel::new("no-cache", "fp8", "off", "off"),
            &tally,
            &[],
            &[0.002],
            Some(0),
        );
        let na = EvidenceRow::unavailable(
            &ConfigLabel::new("fp8+host+pd", "fp8", "on", "on"),
            "needs the cache-backed engine",
        );
        let text = render_table(&[row.clone(), na.clone()]);
        assert!(text.contains("1 (25.0%)"), "{text}");
        assert!(
            text.contains("unavailable: needs the cache-backed engine"),
            "{text}"
        );
        let json = serde_json::to_value(&na).unwrap_or_default();
        assert!(json["corrupted"].is_null() && json["ttft_p99_ms"].is_null());
        let json = serde_json::to_value(&row).unwrap_or_default();
        assert_eq!(json["corrupted"], 1);
        assert!(json["host_hit_rate"].is_null(), "no host tier, no hit rate");
        assert_eq!(json["health_p99_ms"], 2.0);
    }
}
