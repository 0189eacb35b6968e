//! One timeline for a request: stretches of time that do not overlap, each
//! charged to one cause. Painting a stretch charges it anew, so the most
//! specific evidence (a failed call, painted last) wins where spans overlap.

use super::Cause;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Seg {
    pub start: u64,
    pub end: u64,
    pub cause: Cause,
}

#[derive(Debug, Default, Clone)]
pub struct Timeline {
    /// Sorted by start, not overlapping.
    segs: Vec<Seg>,
}

impl Timeline {
    /// Charge `[start, end)` to `cause`, over whatever was charged there.
    pub fn paint(&mut self, start: u64, end: u64, cause: Cause) {
        if end <= start {
            return;
        }
        let mut out = Vec::with_capacity(self.segs.len() + 2);
        for s in self.segs.drain(..) {
            if s.end <= start || s.start >= end {
                out.push(s);
                continue;
            }
            if s.start < start {
                out.push(Seg { end: start, ..s });
            }
            if s.end > end {
                out.push(Seg { start: end, ..s });
            }
        }
        out.push(Seg { start, end, cause });
        out.sort_by_key(|s| s.start);
        self.segs = out;
    }

    pub fn segs(&self) -> &[Seg] {
        &self.segs
    }

    /// Nanoseconds charged to `cause`.
    pub fn total(&self, cause: Cause) -> u64 {
        self.segs.iter().filter(|s| s.cause == cause).map(|s| s.end - s.start).sum()
    }
}

/// `[start, end)` less the union of `cover`: the pieces no covering interval touches.
pub fn uncovered(start: u64, end: u64, cover: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut cover: Vec<(u64, u64)> = cover.iter().copied().filter(|(a, b)| b > a).collect();
    cover.sort_unstable();
    let mut out = Vec::new();
    let mut at = start;
    for (a, b) in cover {
        if b <= at {
            continue;
        }
        if a >= end {
            break;
        }
        if a > at {
            out.push((at, a.min(end)));
        }
        at = at.max(b);
        if at >= end {
            return out;
        }
    }
    if at < end {
        out.push((at, end));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paint_overrides_and_keeps_the_rest() {
        let mut t = Timeline::default();
        t.paint(0, 100, Cause::Gateway);
        t.paint(10, 90, Cause::Router);
        t.paint(40, 60, Cause::Failed);
        assert_eq!(t.total(Cause::Gateway), 20);
        assert_eq!(t.total(Cause::Router), 60);
        assert_eq!(t.total(Cause::Failed), 20);
        let sum: u64 = t.segs().iter().map(|s| s.end - s.start).sum();
        assert_eq!(sum, 100);
        assert!(t.segs().windows(2).all(|w| w[0].end <= w[1].start));
    }

    #[test]
    fn uncovered_pieces() {
        assert_eq!(uncovered(0, 100, &[]), vec![(0, 100)]);
        assert_eq!(uncovered(0, 100, &[(0, 100)]), vec![]);
        assert_eq!(uncovered(0, 100, &[(10, 20), (15, 30), (50, 200)]), vec![(0, 10), (30, 50)]);
        assert_eq!(uncovered(10, 20, &[(0, 5), (25, 30)]), vec![(10, 20)]);
    }
}
