//! A/B: two targets (or two labelled configurations) measured run by run,
//! interleaved (A, B, A, B, ...) at each load point so drift on the machine
//! hits both alike; the report gives B/A per point with its spread, and
//! flags a throughput curve that falls as load rises.

use serde::Serialize;

use crate::report::Point;

#[derive(Clone, Debug, Serialize)]
pub struct AbPoint {
    pub level: f64,
    /// Output tokens/s of each A run and each B run, in run order.
    pub a_tps: Vec<f64>,
    pub b_tps: Vec<f64>,
    /// B/A of the medians, and the lowest and highest per-round B/A.
    pub ratio_tps: f64,
    pub ratio_min: f64,
    pub ratio_max: f64,
    /// B/A of the median TTFT p50s.
    pub ratio_ttft_p50: Option<f64>,
}

fn median(v: &[f64]) -> f64 {
    let mut v = v.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        f64::NAN
    } else {
        v[v.len() / 2]
    }
}

/// Compare the rounds of A and B at one level (`a[i]` and `b[i]` ran back to back).
pub fn compare(level: f64, a: &[Point], b: &[Point]) -> AbPoint {
    let a_tps: Vec<f64> = a.iter().map(|p| p.output_tokens_per_s).collect();
    let b_tps: Vec<f64> = b.iter().map(|p| p.output_tokens_per_s).collect();
    let per_round: Vec<f64> = a_tps.iter().zip(&b_tps).filter(|(x, _)| **x > 0.0).map(|(x, y)| y / x).collect();
    let ttft = |ps: &[Point]| {
        let v: Vec<f64> = ps.iter().filter_map(|p| p.ttft_s.as_ref().map(|t| t.p50)).collect();
        (!v.is_empty()).then(|| median(&v))
    };
    let ratio_ttft_p50 = match (ttft(a), ttft(b)) {
        (Some(x), Some(y)) if x > 0.0 => Some(y / x),
        _ => None,
    };
    AbPoint {
        level,
        ratio_tps: median(&b_tps) / median(&a_tps),
        ratio_min: per_round.iter().copied().fold(f64::INFINITY, f64::min),
        ratio_max: per_round.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        a_tps,
        b_tps,
        ratio_ttft_p50,
    }
}

/// Levels (in order) where throughput fell below 90% of the best seen at
/// a lower load: the curve bends the wrong way there.
pub fn falling(levels_tps: &[(f64, f64)]) -> Vec<f64> {
    let mut best = 0.0f64;
    let mut out = Vec::new();
    for (level, tps) in levels_tps {
        if *tps < 0.9 * best {
            out.push(*level);
        }
        best = best.max(*tps);
    }
    out
}

pub fn markdown(label_a: &str, label_b: &str, points: &[AbPoint]) -> String {
    let mut s = format!("\n## A/B: {label_b} vs {label_a} (interleaved runs)\n\n| level | {label_a} tok/s (median) | {label_b} tok/s (median) | B/A | B/A spread | TTFT p50 B/A |\n|---|---|---|---|---|---|\n");
    for p in points {
        s.push_str(&format!(
            "| {} | {:.1} | {:.1} | {:.3} | {:.3}-{:.3} | {} |\n",
            p.level,
            median(&p.a_tps),
            median(&p.b_tps),
            p.ratio_tps,
            p.ratio_min,
            p.ratio_max,
            p.ratio_ttft_p50.map(|r| format!("{r:.3}")).unwrap_or_else(|| "-".into())
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_falling_curve_is_flagged_where_it_falls() {
        assert!(super::falling(&[(1.0, 10.0), (4.0, 30.0), (16.0, 40.0)]).is_empty());
        assert_eq!(super::falling(&[(1.0, 10.0), (4.0, 30.0), (16.0, 25.0), (32.0, 31.0)]), vec![16.0]);
    }
}
