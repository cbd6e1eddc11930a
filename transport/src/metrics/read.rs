//! Reading an exposition back (what METRICS answers and `GET /metrics` serves), for `vovp
//! top`: the text is parsed by prometheus-parse; this module only looks samples up and turns a
//! histogram's buckets into quantiles, as Prometheus' `histogram_quantile` does.
//!
//! prometheus-parse gathers a histogram's `_bucket` lines into one sample (named without the
//! suffix, `le` taken out of its labels) and keeps `_sum` and `_count` as plain samples; it
//! splits label lists at commas, which none of the daemon's label values contain (opcode and
//! status names, pids, states, the version).

use prometheus_parse::{Sample, Scrape, Value};

/// The samples of one exposition.
#[derive(Debug, Clone)]
pub struct Exposition {
    samples: Vec<Sample>,
}

impl Exposition {
    /// The samples of `text`; lines that are no sample are skipped (a newer daemon may write
    /// more than this reader knows).
    pub fn parse(text: &str) -> Self {
        let lines = text.lines().map(|l| Ok(l.to_owned()));
        Exposition {
            // Reading lines from a string cannot fail.
            samples: Scrape::parse(lines).map_or_else(|_| Vec::new(), |s| s.samples),
        }
    }

    /// The value of the first counter, gauge or untyped sample of `name` that has all of
    /// `labels`.
    pub fn value(&self, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        self.all(name)
            .find(|(l, _)| has(l, labels))
            .map(|(_, value)| value)
    }

    /// Every counter, gauge or untyped sample of `name`: its labels and value.
    pub fn all<'a>(
        &'a self,
        name: &'a str,
    ) -> impl Iterator<Item = (&'a prometheus_parse::Labels, f64)> + 'a {
        self.samples
            .iter()
            .filter(move |s| s.metric == name)
            .filter_map(|s| match s.value {
                Value::Counter(v) | Value::Gauge(v) | Value::Untyped(v) => Some((&s.labels, v)),
                _ => None,
            })
    }

    /// The histogram `name` of the series with `labels`: its cumulative buckets by upper
    /// bound, `+Inf` last. `None` when there is no such histogram.
    pub fn histogram(&self, name: &str, labels: &[(&str, &str)]) -> Option<Histogram> {
        self.samples
            .iter()
            .filter(|s| s.metric == name && has(&s.labels, labels))
            .find_map(|s| match &s.value {
                Value::Histogram(counts) => {
                    let mut buckets: Vec<(f64, f64)> =
                        counts.iter().map(|c| (c.less_than, c.count)).collect();
                    buckets.sort_by(|a, b| a.0.total_cmp(&b.0));
                    Some(Histogram { buckets })
                }
                _ => None,
            })
    }
}

/// Whether `labels` has every pair of `wanted`.
fn has(labels: &prometheus_parse::Labels, wanted: &[(&str, &str)]) -> bool {
    wanted.iter().all(|(k, v)| labels.get(k) == Some(*v))
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

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: &str = "# HELP vovp_used_bytes Used.\n\
        # TYPE vovp_used_bytes gauge\n\
        vovp_used_bytes 4096\n\
        # TYPE vovp_objects gauge\n\
        vovp_objects{state=\"sealed\"} 2\n\
        # TYPE h histogram\n\
        h_bucket{op=\"GET\",le=\"1e-6\"} 1\n\
        h_bucket{op=\"GET\",le=\"2e-6\"} 3\n\
        h_bucket{op=\"GET\",le=\"+Inf\"} 4\n\
        h_count{op=\"GET\"} 4\n\
        not a sample\n";

    #[test]
    fn samples_by_name_and_labels() {
        let e = Exposition::parse(PAGE);
        assert_eq!(e.value("vovp_used_bytes", &[]), Some(4096.0));
        assert_eq!(e.value("vovp_objects", &[("state", "sealed")]), Some(2.0));
        assert_eq!(e.value("vovp_objects", &[("state", "unsealed")]), None);
        assert_eq!(e.value("h_count", &[("op", "GET")]), Some(4.0));
        assert_eq!(e.all("h").count(), 0, "a histogram is no scalar");
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
