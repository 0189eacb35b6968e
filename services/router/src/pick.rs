//! Choosing a worker: the policy as a pure function over what the router
//! knows of each candidate, so it is tested with no network.

/// A worker's own load, from its Load RPC (all routers' requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Polled {
    /// Running plus queued (plus, for decode, waiting for KV).
    pub busy: u32,
    pub kv_free: u32,
    /// Prompt tokens waiting for a prefill step (prefill workers).
    pub queued_tokens: u64,
}

/// What the policy knows of one candidate worker.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Candidate {
    /// Requests this router has in flight there.
    pub in_flight_here: u32,
    /// The worker's load as last polled.
    pub polled: Polled,
    /// Already tried (and refused or failed) for this request.
    pub tried: bool,
    /// Leading full blocks of this request's prompt the worker has cached,
    /// as far as the router knows (prefill workers with a prefix cache).
    pub overlap_blocks: u32,
}

impl Candidate {
    /// The busier of the two views: this router's count lags nothing, the
    /// polled count includes other routers' requests.
    fn busy(&self) -> u32 {
        self.in_flight_here.max(self.polled.busy)
    }
}

/// The least busy candidate not yet tried; ties go to the one with more
/// free KV blocks, then to the first in rotation order from `rotation`
/// (so equal workers share the load). `None` when every one was tried.
pub fn least_busy(candidates: &[Candidate], rotation: usize) -> Option<usize> {
    let n = candidates.len();
    (0..n)
        .map(|i| (i + rotation) % n.max(1))
        .filter(|&i| !candidates[i].tried)
        .min_by_key(|&i| (candidates[i].busy(), std::cmp::Reverse(candidates[i].polled.kv_free)))
}

/// Why a worker was chosen: the branch of the policy taken.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Branch {
    /// Least busy (the policy is least-busy, or the request is too short
    /// to have a full block).
    LeastBusy,
    /// Loads were out of balance: least busy, whatever the cache holds.
    Imbalanced,
    /// Some worker holds enough of the prompt: the best match (least busy among equals).
    CacheMatch,
    /// No worker holds enough of the prompt: least busy.
    LowMatch,
}

impl Branch {
    pub const ALL: [Branch; 4] = [Branch::LeastBusy, Branch::Imbalanced, Branch::CacheMatch, Branch::LowMatch];

    /// The label on the `route` span and in metrics.
    pub fn label(self) -> &'static str {
        match self {
            Branch::LeastBusy => "least_busy",
            Branch::Imbalanced => "imbalanced",
            Branch::CacheMatch => "cache_match",
            Branch::LowMatch => "low_match",
        }
    }
}

/// Where a prompt is prefilled (conditional disaggregation).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    /// By the chosen decode worker itself: no transfer, no second hop.
    Local,
    /// By a prefill worker; the KV moves to the decode worker.
    Remote,
}

impl Mode {
    pub const ALL: [Mode; 2] = [Mode::Local, Mode::Remote];

    pub fn label(self) -> &'static str {
        match self {
            Mode::Local => "local",
            Mode::Remote => "remote",
        }
    }
}

/// Local when the prompt tokens the decode worker would compute (those
/// not in its prefix cache, as far as the router knows) are at most
/// `max_local` (0 turns local prefill off). Returns the mode, its reason
/// (for the `route` span) and that tail.
pub fn prefill_mode(max_local: u32, prompt_tokens: u32, decode_cached_tokens: u32) -> (Mode, &'static str, u32) {
    // The last prompt token is always computed: its logits pick the first token.
    let tail = prompt_tokens.saturating_sub(decode_cached_tokens).max(1);
    if max_local == 0 {
        (Mode::Remote, "disabled", tail)
    } else if tail <= max_local {
        (Mode::Local, "tail_within_threshold", tail)
    } else {
        (Mode::Remote, "tail_over_threshold", tail)
    }
}

/// The thresholds of the cache-aware policy (`--cache-threshold`,
/// `--balance-abs-threshold`, `--balance-rel-threshold`).
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CacheAware {
    /// Least share of the prompt's full blocks a worker must hold for the
    /// request to go to it rather than to the least busy worker.
    pub cache_threshold: f64,
    /// Loads are out of balance when the busiest candidate has more than
    /// this many requests over the least busy one ...
    pub balance_abs: u32,
    /// ... and more than this many times its load.
    pub balance_rel: f64,
}

/// SGLang's cache-aware rule over the polled prefix caches: when loads
/// are out of balance, least busy; else, if the best-holding worker holds
/// at least `cache_threshold` of the prompt's `prompt_blocks` full blocks,
/// that worker (least busy among equals); else least busy.
pub fn cache_aware(
    candidates: &[Candidate],
    rotation: usize,
    prompt_blocks: u32,
    knobs: &CacheAware,
) -> Option<(usize, Branch)> {
    let fallback = least_busy(candidates, rotation)?;
    let open: Vec<usize> = (0..candidates.len()).filter(|&i| !candidates[i].tried).collect();
    let loads = open.iter().map(|&i| candidates[i].busy());
    let (min, max) = (loads.clone().min().unwrap_or(0), loads.max().unwrap_or(0));
    if max - min > knobs.balance_abs && f64::from(max) > f64::from(min) * knobs.balance_rel {
        return Some((fallback, Branch::Imbalanced));
    }
    if prompt_blocks == 0 {
        return Some((fallback, Branch::LeastBusy));
    }
    let best = open.iter().map(|&i| candidates[i].overlap_blocks).max().unwrap_or(0);
    if best == 0 || f64::from(best) < knobs.cache_threshold * f64::from(prompt_blocks) {
        return Some((fallback, Branch::LowMatch));
    }
    let holders: Vec<Candidate> =
        candidates.iter().map(|c| Candidate { tried: c.tried || c.overlap_blocks < best, ..*c }).collect();
    least_busy(&holders, rotation).map(|i| (i, Branch::CacheMatch))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(here: u32, busy: u32, kv_free: u32) -> Candidate {
        Candidate { in_flight_here: here, polled: Polled { busy, kv_free, queued_tokens: 0 }, ..Default::default() }
    }

    fn holding(busy: u32, overlap_blocks: u32) -> Candidate {
        Candidate { overlap_blocks, ..c(0, busy, 10) }
    }

    const KNOBS: CacheAware = CacheAware { cache_threshold: 0.5, balance_abs: 4, balance_rel: 1.5 };

    #[test]
    fn the_worker_holding_the_prompt_wins_even_if_busier() {
        let list = [holding(1, 0), holding(3, 8)];
        assert_eq!(cache_aware(&list, 0, 10, &KNOBS), Some((1, Branch::CacheMatch)));
    }

    #[test]
    fn below_the_threshold_the_least_busy_wins() {
        let list = [holding(1, 0), holding(3, 4)];
        assert_eq!(cache_aware(&list, 0, 10, &KNOBS), Some((0, Branch::LowMatch)));
        assert_eq!(cache_aware(&list, 0, 0, &KNOBS), Some((0, Branch::LeastBusy)), "no full block to match");
    }

    #[test]
    fn out_of_balance_loads_override_the_cache() {
        // 9 - 1 > 4 and 9 > 1.5 * 1.
        let list = [holding(1, 0), holding(9, 10)];
        assert_eq!(cache_aware(&list, 0, 10, &KNOBS), Some((0, Branch::Imbalanced)));
        // Within the absolute threshold the cache still wins.
        let list = [holding(1, 0), holding(5, 10)];
        assert_eq!(cache_aware(&list, 0, 10, &KNOBS), Some((1, Branch::CacheMatch)));
    }

    #[test]
    fn among_equal_holders_the_least_busy_and_tried_ones_are_skipped() {
        let mut list = [holding(4, 6), holding(2, 6), holding(0, 1)];
        assert_eq!(cache_aware(&list, 0, 8, &KNOBS), Some((1, Branch::CacheMatch)));
        list[1].tried = true;
        assert_eq!(cache_aware(&list, 0, 8, &KNOBS), Some((0, Branch::CacheMatch)));
        list[0].tried = true;
        assert_eq!(cache_aware(&list, 0, 8, &KNOBS), Some((2, Branch::LowMatch)));
        list[2].tried = true;
        assert_eq!(cache_aware(&list, 0, 8, &KNOBS), None);
    }

    #[test]
    fn the_least_busy_worker_wins() {
        assert_eq!(least_busy(&[c(3, 0, 10), c(1, 0, 10), c(2, 0, 10)], 0), Some(1));
    }

    #[test]
    fn other_routers_load_counts_through_the_polled_view() {
        // Worker 0 has nothing from this router but 9 requests from others.
        assert_eq!(least_busy(&[c(0, 9, 10), c(2, 2, 10)], 0), Some(1));
    }

    #[test]
    fn ties_go_to_more_free_kv_then_rotate() {
        assert_eq!(least_busy(&[c(1, 1, 5), c(1, 1, 50)], 0), Some(1));
        let equal = [c(1, 1, 5), c(1, 1, 5), c(1, 1, 5)];
        assert_eq!(least_busy(&equal, 0), Some(0));
        assert_eq!(least_busy(&equal, 1), Some(1));
        assert_eq!(least_busy(&equal, 5), Some(2));
    }

    #[test]
    fn tried_workers_are_skipped_and_none_is_left_at_the_end() {
        let mut list = [c(0, 0, 10), c(5, 5, 10)];
        assert_eq!(list[0].overlap_blocks, 0);
        list[0].tried = true;
        assert_eq!(least_busy(&list, 0), Some(1));
        list[1].tried = true;
        assert_eq!(least_busy(&list, 0), None);
        assert_eq!(least_busy(&[], 3), None);
    }

    #[test]
    fn local_prefill_below_the_threshold_remote_above_it() {
        use super::{prefill_mode, Mode};
        assert_eq!(prefill_mode(0, 10, 0), (Mode::Remote, "disabled", 10));
        assert_eq!(prefill_mode(64, 64, 0), (Mode::Local, "tail_within_threshold", 64));
        assert_eq!(prefill_mode(64, 65, 0), (Mode::Remote, "tail_over_threshold", 65));
        // A long prompt whose head the decode worker holds: only the tail counts.
        assert_eq!(prefill_mode(64, 1000, 960), (Mode::Local, "tail_within_threshold", 40));
        // All cached still computes one token.
        assert_eq!(prefill_mode(64, 32, 32), (Mode::Local, "tail_within_threshold", 1));
    }
}
