//! `sparsekit repro --report DIR`: the run as a page a person reads — `index.html` with the
//! tables and two pictures (TTFT by turn per configuration; what the checks caught and
//! what got through, per configuration), the pictures as SVG files beside it, and the
//! run's JSON (`report.json`, the schema of `docs/repro.md`).

use std::fmt::Write as _;
use std::path::Path;

use plotters::prelude::*;
use sparsekit_server::harness::report::{EvidenceRow, RunReport};

use super::CliError;

/// Colours of the configurations' lines, cycled.
const PALETTE: [RGBColor; 9] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(23, 190, 207),
];

fn plot_err(e: impl std::fmt::Display) -> CliError {
    format!("cannot draw the report's pictures: {e}").into()
}

/// Writes the report into `dir` (created if missing).
pub fn write(dir: &Path, report: &RunReport) -> Result<(), CliError> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let ttft = dir.join("ttft_by_turn.svg");
    ttft_by_turn(&ttft, &report.rows)?;
    let checks = dir.join("integrity.svg");
    integrity(&checks, &report.rows)?;
    let json = serde_json::to_string_pretty(report)?;
    std::fs::write(dir.join("report.json"), json)
        .map_err(|e| format!("cannot write report.json: {e}"))?;
    std::fs::write(dir.join("index.html"), html(report))
        .map_err(|e| format!("cannot write index.html: {e}"))?;
    Ok(())
}

/// TTFT p50 by turn, one line per measured configuration (and round).
fn ttft_by_turn(path: &Path, rows: &[EvidenceRow]) -> Result<(), CliError> {
    let series: Vec<(String, Vec<(f64, f64)>)> = rows
        .iter()
        .filter(|r| r.available)
        .map(|r| {
            let name = match r.round {
                Some(k) => format!("{} r{k}", r.config),
                None => r.config.clone(),
            };
            let pts = r
                .ttft_by_turn_ms
                .iter()
                .filter_map(|t| Some((t.turn as f64, t.p50_ms?)))
                .collect();
            (name, pts)
        })
        .filter(|(_, p): &(String, Vec<(f64, f64)>)| !p.is_empty())
        .collect();
    let turns = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.0))
        .fold(1.0, f64::max);
    let top = series
        .iter()
        .flat_map(|(_, p)| p.iter().map(|x| x.1))
        .fold(1.0, f64::max)
        * 1.1;
    let root = SVGBackend::new(path, (900, 480)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("TTFT p50 by turn (ms)", ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(56)
        .build_cartesian_2d(0.5..turns + 0.5, 0.0..top)
        .map_err(plot_err)?;
    chart
        .configure_mesh()
        .x_desc("turn")
        .y_desc("ms")
        .x_labels(turns as usize)
        .draw()
        .map_err(plot_err)?;
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = PALETTE[i % PALETTE.len()];
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), c.stroke_width(2)))
            .map_err(plot_err)?
            .label(name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], c.stroke_width(2)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 3, c.filled())))
            .map_err(plot_err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_err)?;
    root.present().map_err(plot_err)?;
    Ok(())
}

/// Per configuration: sessions corrupted (red), refused (orange) and the integrity
/// events the checks counted (blue), side by side.
fn integrity(path: &Path, rows: &[EvidenceRow]) -> Result<(), CliError> {
    let measured: Vec<&EvidenceRow> = rows.iter().filter(|r| r.available).collect();
    let n = measured.len().max(1);
    let top = measured
        .iter()
        .flat_map(|r| {
            [
                r.corrupted.unwrap_or(0) as f64,
                r.refused.unwrap_or(0) as f64,
                r.detected.unwrap_or(0) as f64,
            ]
        })
        .fold(1.0, f64::max)
        * 1.15;
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "corrupted (red), refused (orange), detected by the checks (blue)",
            ("sans-serif", 18),
        )
        .margin(12)
        .x_label_area_size(70)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..n as f64, 0.0..top)
        .map_err(plot_err)?;
    let names: Vec<String> = measured.iter().map(|r| r.config.clone()).collect();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            names.get(i).cloned().unwrap_or_default()
        })
        .y_desc("count")
        .draw()
        .map_err(plot_err)?;
    let bars = [(RED, 0.1), (RGBColor(255, 140, 0), 0.37), (BLUE, 0.64)];
    for (i, r) in measured.iter().enumerate() {
        let values = [
            r.corrupted.unwrap_or(0) as f64,
            r.refused.unwrap_or(0) as f64,
            r.detected.unwrap_or(0) as f64,
        ];
        for ((color, off), v) in bars.iter().zip(values) {
            let x0 = i as f64 + off;
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [(x0, 0.0), (x0 + 0.25, v)],
                    color.filled(),
                )))
                .map_err(plot_err)?;
        }
    }
    root.present().map_err(plot_err)?;
    Ok(())
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or_else(|| "-".into(), |x| x.to_string())
}

fn optf(v: Option<f64>, digits: usize) -> String {
    v.map_or_else(|| "-".into(), |x| format!("{x:.digits$}"))
}

/// The page: what ran, the two tables, the pictures, each row's notes.
fn html(r: &RunReport) -> String {
    let mut h = String::new();
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>sparsekit repro</title>\
         <style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse;\
         margin:1em 0}}td,th{{border:1px solid #ccc;padding:3px 8px;text-align:right}}\
         td:first-child,th:first-child{{text-align:left}}.bad{{background:#fdd}}\
         .ok{{background:#dfd}}</style></head><body><h1>sparsekit repro</h1>\
         <p><code>{}</code></p><p>{} sessions × {} turns, {} round(s), model {}, backend {}, \
         {:.1} s; reference comparison {}; checks {}{}</p>",
        esc(&r.command),
        r.sessions,
        r.turns,
        r.rounds,
        esc(&r.model),
        esc(&r.backend),
        r.wall_seconds,
        if r.reference {
            "on"
        } else {
            "off (only the checks judge)"
        },
        if r.verify { "on" } else { "off (--no-verify)" },
        r.injection
            .as_ref()
            .map_or(String::new(), |i| format!("; injection <b>{}</b>", esc(i)))
    );
    if let Some(s) = &r.sizing {
        let _ = write!(
            h,
            "<p>pools (pages): device {}, host {}, PD decode {}, small decode {}</p>",
            s.device_pages, s.host_pages, s.decode_pages, s.small_decode_pages
        );
    }
    h.push_str(
        "<h2>Integrity</h2><table><tr><th>config</th><th>round</th><th>sessions</th>\
         <th>corrupted</th><th>refused</th><th>detected</th><th>fallbacks</th>\
         <th>kernel checks</th><th>wedged</th><th>leaked</th><th>quarantined</th>\
         <th>verdict</th></tr>",
    );
    for row in &r.rows {
        if !row.available {
            let _ = write!(
                h,
                "<tr><td>{}</td><td colspan=\"11\">unavailable: {}</td></tr>",
                esc(&row.config),
                esc(row.note.as_deref().unwrap_or(""))
            );
            continue;
        }
        let bad = row.corrupted.unwrap_or(0) > 0
            || row.wedged.unwrap_or(0) > 0
            || row.leaked_pages.unwrap_or(0) > 0
            || row.verdict.is_some_and(|v| !v.is_expected(row));
        let kernel = match (row.kernel_checks, row.kernel_mismatches) {
            (Some(n), Some(m)) => format!("{m} of {n} differ"),
            _ => "-".into(),
        };
        let _ = write!(
            h,
            "<tr class=\"{}\"><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            if bad { "bad" } else { "ok" },
            esc(&row.config),
            opt(row.round),
            opt(row.sessions),
            if row.reference {
                opt(row.corrupted)
            } else {
                "no reference".into()
            },
            opt(row.refused),
            opt(row.detected),
            opt(row.fallbacks),
            kernel,
            opt(row.wedged),
            opt(row.leaked_pages),
            opt(row.quarantined_pages),
            row.verdict.map_or("-", |v| v.name())
        );
    }
    h.push_str(
        "</table><h2>Serving</h2><table><tr><th>config</th><th>round</th>\
         <th>TTFT p50 ms</th><th>TTFT p99 ms</th><th>/health p99 ms</th>\
         <th>device hits %</th><th>host hits %</th><th>host-tier speed-up t3+</th></tr>",
    );
    for row in r.rows.iter().filter(|x| x.available) {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td>\
             <td>{}</td><td>{}</td></tr>",
            esc(&row.config),
            opt(row.round),
            optf(row.ttft_p50_ms, 1),
            optf(row.ttft_p99_ms, 1),
            optf(row.health_p99_ms, 2),
            optf(row.device_hit_rate.map(|x| x * 100.0), 1),
            optf(row.host_hit_rate.map(|x| x * 100.0), 1),
            optf(row.ttft_speedup_turn3plus, 2)
        );
    }
    h.push_str(
        "</table><h2>Pictures</h2><p><img src=\"ttft_by_turn.svg\" alt=\"TTFT by turn\"></p>\
         <p><img src=\"integrity.svg\" alt=\"corrupted, refused, detected\"></p><h2>Notes</h2><ul>",
    );
    for row in r.rows.iter().filter(|x| x.available) {
        let mut parts: Vec<String> = row.note.iter().map(|n| esc(n)).collect();
        if !row.caught_by.is_empty() {
            let by: Vec<String> = row
                .caught_by
                .iter()
                .map(|c| format!("{} {}", esc(&c.check), c.count))
                .collect();
            parts.push(format!("caught by {}", by.join(", ")));
        }
        if !parts.is_empty() {
            let _ = write!(
                h,
                "<li><b>{}</b>: {}</li>",
                esc(&row.config),
                parts.join("; ")
            );
        }
    }
    h.push_str("</ul><p>The data: <a href=\"report.json\">report.json</a></p></body></html>\n");
    h
}
