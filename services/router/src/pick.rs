//! Choosing a worker: the policy as a pure function over what the router
//! knows of each candidate, so it is tested with no network.

/// A worker's own load, from its Load RPC (all routers' requests).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Polled {
    /// Running plus queued (plus, for decode, waiting for KV).
    pub busy: u32,
    pub kv_free: u32,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn c(here: u32, busy: u32, kv_free: u32) -> Candidate {
        Candidate { in_flight_here: here, polled: Polled { busy, kv_free }, tried: false }
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
        list[0].tried = true;
        assert_eq!(least_busy(&list, 0), Some(1));
        list[1].tried = true;
        assert_eq!(least_busy(&list, 0), None);
        assert_eq!(least_busy(&[], 3), None);
    }
}
