//! Reading an exposition back: the samples of a Prometheus text page (what METRICS answers
//! and `GET /metrics` serves), and histogram quantiles from them, for `vovp top`.
//!
//! A reader of the subset of the format an exposition has: `# ...` lines are skipped, every
//! other line is `name{label="value",...} value [timestamp]` (label values with `\\`, `\"`
//! and `\n` escapes). A line it cannot read is skipped, not an error: a newer daemon may
//! write more than this reader knows.

use std::collections::BTreeMap;

/// One sample.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub name: String,
    pub labels: Vec<(String, String)>,
    pub value: f64,
}

impl Sample {
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }

    fn has(&self, labels: &[(&str, &str)]) -> bool {
        labels.iter().all(|(k, v)| self.label(k) == Some(*v))
    }
}

/// The samples of one exposition.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Exposition {
    pub samples: Vec<Sample>,
}

impl Exposition {
    pub fn parse(text: &str) -> Self {
        Exposition {
            samples: text.lines().filter_map(sample).collect(),
        }
    }

    /// The value of the first sample of `name` that has all of `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.samples
            .iter()
            .find(|s| s.name == name && s.has(labels))
            .map(|s| s.value)
    }

    /// Every sample of `name`.
    pub fn all<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a Sample> + 'a {
        self.samples.iter().filter(move |s| s.name == name)
    }

    /// The histogram `name` (without `_bucket`) of the series with `labels`: its cumulative
    /// buckets by upper bound, `+Inf` last. `None` when it has no buckets.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Option<Histogram> {
        let bucket = format!("{name}_bucket");
        let mut buckets: Vec<(f64, f64)> = self
            .all(&bucket)
            .filter(|s| s.has(labels))
            .filter_map(|s| Some((parse_value(s.label("le")?)?, s.value)))
            .collect();
        if buckets.is_empty() {
            return None;
        }
        buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
        Some(Histogram { buckets })
    }

    /// The values of label `key` that samples of `name` carry, each once, sorted.
    pub fn label_values(&self, name: &str, key: &str) -> Vec<String> {
        let set: BTreeMap<&str, ()> = self
            .all(name)
            .filter_map(|s| s.label(key))
            .map(|v| (v, ()))
            .collect();
        set.into_keys().map(str::to_owned).collect()
    }
}

/// A histogram's cumulative buckets: (upper bound, observations at or below it).
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub buckets: Vec<(f64, f64)>,
}

impl Histogram {
    /// Observations in all.
    pub fn count(&self) -> f64 {
        self.buckets.last().map_or(0.0, |b| b.1)
    }

    /// What was observed since `earlier` (the same series read before): bucket by bucket.
    /// A reset (the daemon restarted: a count went down) gives `self` whole.
    pub fn since(&self, earlier: &Histogram) -> Histogram {
        let same_bounds = earlier.buckets.len() == self.buckets.len()
            && earlier
                .buckets
                .iter()
                .zip(&self.buckets)
                .all(|(a, b)| a.0 == b.0);
        let reset = self.count() < earlier.count();
        if !same_bounds || reset {
            return self.clone();
        }
        Histogram {
            buckets: self
                .buckets
                .iter()
                .zip(&earlier.buckets)
                .map(|(now, then)| (now.0, now.1 - then.1))
                .collect(),
        }
    }

    /// The `q` quantile (0..=1), interpolated linearly inside its bucket as Prometheus'
    /// `histogram_quantile` does (from 0 in the first bucket; the last bounded bound when it
    /// falls in `+Inf`). `None` with no observations.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total <= 0.0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total;
        let mut lower = (0.0, 0.0);
        for &(bound, cumulative) in &self.buckets {
            if cumulative >= rank && cumulative > 0.0 {
                if bound.is_infinite() {
                    return Some(lower.0);
                }
                let inside = cumulative - lower.1;
                let fraction = if inside > 0.0 {
                    (rank - lower.1) / inside
                } else {
                    1.0
                };
                return Some(lower.0 + (bound - lower.0) * fraction);
            }
            lower = (bound, cumulative);
        }
        Some(lower.0)
    }
}

/// `+Inf`, `-Inf`, `NaN` or a number.
fn parse_value(s: &str) -> Option<f64> {
    match s {
        "+Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        "NaN" => Some(f64::NAN),
        _ => s.parse().ok(),
    }
}

/// One sample line; `None` for a comment, a blank line or a line this reader cannot read.
fn sample(line: &str) -> Option<Sample> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return None;
    }
    let name_end = line.find(['{', ' '])?;
    let name = &line[..name_end];
    let (labels, rest) = if line[name_end..].starts_with('{') {
        labels(&line[name_end + 1..])?
    } else {
        (Vec::new(), &line[name_end..])
    };
    let value = parse_value(rest.split_whitespace().next()?)?;
    Some(Sample {
        name: name.to_owned(),
        labels,
        value,
    })
}

/// `key="value",...}` and what follows the `}`.
fn labels(mut s: &str) -> Option<(Vec<(String, String)>, &str)> {
    let mut out = Vec::new();
    loop {
        s = s.trim_start_matches([' ', ',']);
        if let Some(rest) = s.strip_prefix('}') {
            return Some((out, rest));
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim().to_owned();
        let mut chars = s[eq + 1..].trim_start().strip_prefix('"')?.char_indices();
        let mut value = String::new();
        let end = loop {
            match chars.next()? {
                (i, '"') => break i,
                (_, '\\') => match chars.next()?.1 {
                    'n' => value.push('\n'),
                    c => value.push(c),
                },
                (_, c) => value.push(c),
            }
        };
        let after_quote = s[eq + 1..].trim_start();
        s = &after_quote[1 + end + 1..];
        out.push((key, value));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP vovp_used_bytes Used.\n\
        # TYPE vovp_used_bytes gauge\n\
        vovp_used_bytes 4096\n\
        vovp_objects{state=\"sealed\"} 2\n\
        weird{a=\"x\\\"y\\\\z\\n\",b=\"\"} 1.5 1700000000000\n\
        h_bucket{op=\"GET\",le=\"1e-6\"} 1\n\
        h_bucket{op=\"GET\",le=\"2e-6\"} 3\n\
        h_bucket{op=\"GET\",le=\"+Inf\"} 4\n\
        not a sample\n";

    #[test]
    fn samples_labels_and_escapes() {
        let e = Exposition::parse(PAGE);
        assert_eq!(e.value("vovp_used_bytes", &[]), Some(4096.0));
        assert_eq!(e.value("vovp_objects", &[("state", "sealed")]), Some(2.0));
        assert_eq!(e.value("vovp_objects", &[("state", "unsealed")]), None);
        let weird = e.all("weird").next().unwrap();
        assert_eq!(weird.label("a"), Some("x\"y\\z\n"));
        assert_eq!((weird.label("b"), weird.value), (Some(""), 1.5));
        assert_eq!(e.label_values("h_bucket", "op"), ["GET"]);
        assert_eq!(e.samples.len(), 6, "the line that is no sample is skipped");
    }

    #[test]
    fn quantiles_interpolate_as_prometheus_does() {
        let h = Exposition::parse(PAGE)
            .histogram("h", &[("op", "GET")])
            .unwrap();
        assert_eq!(h.count(), 4.0);
        // Rank 2 of 4 lies halfway through the second bucket (1..3 observations, 1e-6..2e-6).
        let p50 = h.quantile(0.5).unwrap();
        assert!((p50 - 1.5e-6).abs() < 1e-12, "{p50}");
        assert!((h.quantile(0.25).unwrap() - 1e-6).abs() < 1e-12);
        // In +Inf: the last bounded bound.
        assert_eq!(h.quantile(0.99), Some(2e-6));
        let earlier = Histogram {
            buckets: vec![(1e-6, 1.0), (2e-6, 1.0), (f64::INFINITY, 1.0)],
        };
        let recent = h.since(&earlier);
        assert_eq!(
            recent.buckets,
            vec![(1e-6, 0.0), (2e-6, 2.0), (f64::INFINITY, 3.0)]
        );
        assert_eq!(Histogram { buckets: vec![] }.quantile(0.5), None);
    }
}
