//! What `/metrics` answers: the registries of one or more engines (a `--pd on` server
//! serves its prefill and decode sides, each sample labelled with its `role`) merged into
//! one exposition, in the format the client's `Accept` header asks for — OpenMetrics 1.0
//! or Prometheus text 0.0.4 (the default: what `curl`, `promtool` and most parsers read).
//!
//! The two formats differ, for what this server exposes, in three places: a counter's
//! `HELP`/`TYPE` lines name the family without `_total` in OpenMetrics and the sample
//! name (with `_total`) in Prometheus text; Prometheus text has no `# UNIT` and no
//! `# EOF`; its type for OpenMetrics' `unknown` is `untyped`.

/// An exposition format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    /// `application/openmetrics-text; version=1.0.0`.
    OpenMetrics,
    /// `text/plain; version=0.0.4` (Prometheus' text format).
    Prometheus,
}

impl Format {
    /// The `Content-Type` of a response in this format.
    pub fn content_type(self) -> &'static str {
        match self {
            Format::OpenMetrics => "application/openmetrics-text; version=1.0.0; charset=utf-8",
            Format::Prometheus => "text/plain; version=0.0.4; charset=utf-8",
        }
    }

    /// The format an `Accept` header asks for: OpenMetrics when it lists
    /// `application/openmetrics-text` with a weight at least that of `text/plain` (and
    /// above 0); Prometheus text otherwise (no header, `*/*`, `text/plain`).
    pub fn negotiate(accept: Option<&str>) -> Format {
        let Some(accept) = accept else {
            return Format::Prometheus;
        };
        let (mut om, mut text) = (0.0f32, 0.0f32);
        for range in accept.split(',') {
            let mut parts = range.split(';').map(str::trim);
            let media = parts.next().unwrap_or("").to_ascii_lowercase();
            let q = parts
                .filter_map(|p| p.split_once('='))
                .find(|(k, _)| k.trim().eq_ignore_ascii_case("q"))
                .and_then(|(_, v)| v.trim().parse::<f32>().ok())
                .unwrap_or(1.0);
            match media.as_str() {
                "application/openmetrics-text" => om = om.max(q),
                "text/plain" => text = text.max(q),
                _ => {}
            }
        }
        if om > 0.0 && om >= text {
            Format::OpenMetrics
        } else {
            Format::Prometheus
        }
    }
}

/// One metric family of an exposition.
#[derive(Clone, Debug, Default, PartialEq)]
struct Family {
    name: String,
    kind: String,
    help: String,
    unit: Option<String>,
    samples: Vec<String>,
}

/// Families in order of first appearance, merged by name.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Exposition {
    families: Vec<Family>,
}

/// Adds `role="…"` to a sample line that has no `role` label.
fn with_role(sample: &str, role: &str) -> String {
    let (series, value) = sample.split_once(' ').unwrap_or((sample, ""));
    match series.split_once('{') {
        Some((name, labels)) => {
            let labels = labels.trim_end_matches('}');
            let has_role = labels
                .split(',')
                .any(|l| l.trim_start().starts_with("role="));
            if has_role {
                sample.to_string()
            } else if labels.is_empty() {
                format!("{name}{{role=\"{role}\"}} {value}")
            } else {
                format!("{name}{{{labels},role=\"{role}\"}} {value}")
            }
        }
        None => format!("{series}{{role=\"{role}\"}} {value}"),
    }
}

impl Exposition {
    /// Adds the families of OpenMetrics text (as `prometheus-client` writes it), labelling
    /// every sample with `role` when given (a sample that has a `role` label keeps it).
    pub fn add_openmetrics(&mut self, text: &str, role: Option<&str>) {
        let mut current: Option<usize> = None;
        for line in text.lines() {
            if let Some(rest) = line.strip_prefix("# ") {
                let mut parts = rest.splitn(3, ' ');
                let (Some(kw), Some(name)) = (parts.next(), parts.next()) else {
                    continue;
                };
                let arg = parts.next().unwrap_or("").to_string();
                if kw == "EOF" {
                    continue;
                }
                let i = self.family(name);
                current = Some(i);
                let f = &mut self.families[i];
                match kw {
                    "HELP" => f.help = arg,
                    "TYPE" => f.kind = arg,
                    "UNIT" => f.unit = Some(arg),
                    _ => {}
                }
            } else if !line.trim().is_empty() {
                let i = match current {
                    Some(i) => i,
                    // A sample before any descriptor: a family of its own, untyped.
                    None => self.family(line.split(['{', ' ']).next().unwrap_or(line)),
                };
                let sample = match role {
                    Some(r) => with_role(line, r),
                    None => line.to_string(),
                };
                self.families[i].samples.push(sample);
            }
        }
    }

    fn family(&mut self, name: &str) -> usize {
        match self.families.iter().position(|f| f.name == name) {
            Some(i) => i,
            None => {
                self.families.push(Family {
                    name: name.to_string(),
                    kind: "unknown".into(),
                    ..Default::default()
                });
                self.families.len() - 1
            }
        }
    }

    /// The exposition in `format`.
    pub fn render(&self, format: Format) -> String {
        let mut out = String::new();
        for f in &self.families {
            let (name, kind) = match (format, f.kind.as_str()) {
                (Format::Prometheus, "counter") => (format!("{}_total", f.name), "counter"),
                (Format::Prometheus, "unknown") => (f.name.clone(), "untyped"),
                (_, k) => (f.name.clone(), k),
            };
            out.push_str(&format!("# HELP {name} {}\n# TYPE {name} {kind}\n", f.help));
            if let (Format::OpenMetrics, Some(u)) = (format, &f.unit) {
                out.push_str(&format!("# UNIT {name} {u}\n"));
            }
            for s in &f.samples {
                out.push_str(s);
                out.push('\n');
            }
        }
        if format == Format::OpenMetrics {
            out.push_str("# EOF\n");
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const OM: &str = "# HELP sparsekit_requests Requests.\n# TYPE sparsekit_requests counter\n\
        sparsekit_requests_total{role=\"decode\",status=\"ok\"} 2\n\
        # HELP sparsekit_pages KV pages.\n# TYPE sparsekit_pages gauge\n\
        sparsekit_pages{pool=\"device\",state=\"free\"} 7\n\
        # HELP sparsekit_leaked_pages Leaked.\n# TYPE sparsekit_leaked_pages gauge\n\
        sparsekit_leaked_pages 0\n# EOF\n";

    #[test]
    fn negotiation_follows_accept() {
        assert_eq!(Format::negotiate(None), Format::Prometheus);
        assert_eq!(Format::negotiate(Some("*/*")), Format::Prometheus);
        assert_eq!(
            Format::negotiate(Some("text/plain;version=0.0.4")),
            Format::Prometheus
        );
        // What Prometheus itself sends.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;\
                    version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert_eq!(Format::negotiate(Some(prom)), Format::OpenMetrics);
        assert_eq!(
            Format::negotiate(Some("text/plain, application/openmetrics-text;q=0.5")),
            Format::Prometheus
        );
        assert_eq!(
            Format::negotiate(Some("application/openmetrics-text;q=0")),
            Format::Prometheus
        );
    }

    #[test]
    fn counters_are_named_by_their_samples_in_prometheus_text() {
        let mut e = Exposition::default();
        e.add_openmetrics(OM, None);
        let t = e.render(Format::Prometheus);
        assert!(t.contains("# HELP sparsekit_requests_total Requests.\n# TYPE sparsekit_requests_total counter\n"), "{t}");
        assert!(!t.contains("# EOF"));
        let o = e.render(Format::OpenMetrics);
        assert!(o.contains("# TYPE sparsekit_requests counter\n"), "{o}");
        assert!(o.ends_with("# EOF\n"));
    }

    #[test]
    fn merging_sides_labels_each_sample_once_per_family() {
        let mut e = Exposition::default();
        e.add_openmetrics(OM, Some("decode"));
        e.add_openmetrics(&OM.replace("decode", "prefill"), Some("prefill"));
        let t = e.render(Format::Prometheus);
        assert_eq!(t.matches("# TYPE sparsekit_pages gauge").count(), 1, "{t}");
        assert!(t.contains("sparsekit_pages{pool=\"device\",state=\"free\",role=\"decode\"} 7"));
        assert!(t.contains("sparsekit_pages{pool=\"device\",state=\"free\",role=\"prefill\"} 7"));
        assert!(t.contains("sparsekit_leaked_pages{role=\"prefill\"} 0"));
        // A sample with its own role keeps it.
        assert!(t.contains("sparsekit_requests_total{role=\"prefill\",status=\"ok\"} 2"));
        assert!(!t.contains("role=\"prefill\",status=\"ok\",role"));
    }
}
