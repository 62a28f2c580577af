//! Reading a server's `/metrics` (Prometheus/OpenMetrics text): what the harness learns of
//! a running server's cache (hits by tier, detections, leaked and quarantined pages,
//! whether it is idle) the same way for in-process and external servers.

use std::collections::HashMap;

/// One sample: its labels (name, value) and its value.
type Sample = (Vec<(String, String)>, f64);

/// One scrape: every sample by name with its labels.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Scrape {
    samples: HashMap<String, Vec<Sample>>,
}

fn parse_labels(s: &str) -> Option<Vec<(String, String)>> {
    let mut out = Vec::new();
    let mut rest = s.trim();
    while !rest.is_empty() {
        let eq = rest.find('=')?;
        let name = rest[..eq].trim().trim_start_matches(',').trim().to_string();
        let after = rest[eq + 1..].trim_start();
        let body = after.strip_prefix('"')?;
        let mut value = String::new();
        let mut chars = body.char_indices();
        let mut end = None;
        while let Some((i, c)) = chars.next() {
            match c {
                '\\' => {
                    if let Some((_, n)) = chars.next() {
                        value.push(match n {
                            'n' => '\n',
                            other => other,
                        });
                    }
                }
                '"' => {
                    end = Some(i);
                    break;
                }
                c => value.push(c),
            }
        }
        let end = end?;
        out.push((name, value));
        rest = body[end + 1..]
            .trim_start()
            .trim_start_matches(',')
            .trim_start();
    }
    Some(out)
}

impl Scrape {
    /// Parses exposition text; comment lines and lines it cannot read are skipped.
    pub fn parse(text: &str) -> Scrape {
        let mut samples: HashMap<String, Vec<Sample>> = HashMap::new();
        for line in text.lines() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let Some((series, value)) = line.rsplit_once(' ') else {
                continue;
            };
            let Ok(value) = value.parse::<f64>() else {
                continue;
            };
            let (name, labels) = match series.split_once('{') {
                Some((n, l)) => match parse_labels(l.trim_end_matches('}')) {
                    Some(l) => (n, l),
                    None => continue,
                },
                None => (series, Vec::new()),
            };
            samples
                .entry(name.to_string())
                .or_default()
                .push((labels, value));
        }
        Scrape { samples }
    }

    /// The sum of the samples of `name` whose labels include every pair of `labels`;
    /// `None` when no sample matches.
    pub fn get(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        let mut sum = None;
        for (ls, v) in self.samples.get(name)? {
            if labels
                .iter()
                .all(|(k, want)| ls.iter().any(|(n, x)| n == k && x == want))
            {
                *sum.get_or_insert(0.0) += v;
            }
        }
        sum
    }

    /// [`Scrape::get`], 0 when absent.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> f64 {
        self.get(name, labels).unwrap_or(0.0)
    }

    /// Every value of label `label` among the samples of `name` (sorted, once each).
    pub fn label_values(&self, name: &str, label: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .samples
            .get(name)
            .into_iter()
            .flatten()
            .filter_map(|(ls, _)| ls.iter().find(|(n, _)| n == label).map(|(_, x)| x.clone()))
            .collect();
        v.sort();
        v.dedup();
        v
    }

    /// How much `name` (a counter) grew since `before`.
    pub fn delta(&self, before: &Scrape, name: &str, labels: &[(&str, &str)]) -> f64 {
        (self.value(name, labels) - before.value(name, labels)).max(0.0)
    }

    /// Adds every sample of `other` (several servers of one deployment).
    pub fn merge(&mut self, other: Scrape) {
        for (k, v) in other.samples {
            self.samples.entry(k).or_default().extend(v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_counters_gauges_and_labels() {
        let text = "# HELP x y\n# TYPE sparsekit_refused counter\n\
            sparsekit_refused_total{reason=\"stale_write\"} 2\n\
            sparsekit_refused_total{reason=\"not_landed\"} 3\n\
            sparsekit_cache_hits_total{tier=\"host\"} 40\n\
            sparsekit_leaked_pages 0\n\
            sparsekit_pages{pool=\"device\",state=\"free\"} 17\n\
            odd{a=\"q\\\"uote\"} 1\n# EOF\n";
        let s = Scrape::parse(text);
        assert_eq!(s.get("sparsekit_refused_total", &[]), Some(5.0));
        assert_eq!(
            s.get("sparsekit_refused_total", &[("reason", "not_landed")]),
            Some(3.0)
        );
        assert_eq!(s.get("sparsekit_leaked_pages", &[]), Some(0.0));
        assert_eq!(
            s.get("sparsekit_pages", &[("pool", "device"), ("state", "free")]),
            Some(17.0)
        );
        assert_eq!(s.get("odd", &[("a", "q\"uote")]), Some(1.0));
        assert_eq!(s.get("missing", &[]), None);
        let mut later = Scrape::parse("sparsekit_refused_total{reason=\"stale_write\"} 7\n");
        assert_eq!(
            later.delta(&s, "sparsekit_refused_total", &[("reason", "stale_write")]),
            5.0
        );
        later.merge(Scrape::parse(
            "sparsekit_refused_total{reason=\"stale_write\"} 1\n",
        ));
        assert_eq!(later.value("sparsekit_refused_total", &[]), 8.0);
    }
}
