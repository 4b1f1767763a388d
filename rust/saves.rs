//! Worker-side countdown of async saves.
//!
//! When k > 1 children save a finished request asynchronously, the scheduler
//! side sends "k - 1 extra completions" to the workers in the connector
//! metadata. Each child reports the request in its own `get_finished`; the
//! multiplexer reports it finished sending only when the last one arrives.

use dashmap::DashMap;

#[derive(Debug, Default)]
pub struct SaveCountdown {
    /// request id -> completions still to swallow before reporting it.
    extra: DashMap<String, u32>,
}

impl SaveCountdown {
    pub fn new() -> Self {
        Self::default()
    }

    /// Record that `extra` more completions than usual are expected.
    pub fn expect(&self, req_id: &str, extra: u32) {
        if extra > 0 {
            *self.extra.entry(req_id.to_owned()).or_insert(0) += extra;
        }
    }

    /// One child reported `req_id` finished sending. True when this is the
    /// last expected completion, i.e. the request is finished sending now.
    pub fn complete(&self, req_id: &str) -> bool {
        // remove_if + get_mut would take the shard lock twice; the entry API
        // does the whole read-modify-write under one lock.
        match self.extra.entry(req_id.to_owned()) {
            dashmap::Entry::Vacant(_) => true,
            dashmap::Entry::Occupied(mut e) => {
                if *e.get() <= 1 {
                    e.remove();
                } else {
                    *e.get_mut() -= 1;
                }
                false
            }
        }
    }

    /// Requests still waiting for completions.
    pub fn len(&self) -> usize {
        self.extra.len()
    }

    pub fn is_empty(&self) -> bool {
        self.extra.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    #[test]
    fn unknown_request_finishes_at_once() {
        assert!(SaveCountdown::new().complete("r"));
    }

    #[test]
    fn three_savers_finish_on_the_third_completion() {
        let c = SaveCountdown::new();
        c.expect("r", 2);
        assert!(!c.complete("r"));
        assert!(!c.complete("r"));
        assert!(c.complete("r"));
        assert!(c.is_empty());
    }

    #[test]
    fn batch_reports_each_request_once() {
        let c = SaveCountdown::new();
        c.expect("a", 1);
        let done: Vec<_> = ["a", "b", "a"]
            .into_iter()
            .filter(|id| c.complete(id))
            .collect();
        assert_eq!(done, ["b", "a"]);
        assert!(c.is_empty());
    }

    #[test]
    fn threads_hammering_the_same_ids_lose_no_count() {
        let c = Arc::new(SaveCountdown::new());
        let ids: Vec<String> = (0..16).map(|i| format!("r{i}")).collect();
        // 4 threads each complete every id 250 times: 1000 completions per id,
        // so 999 extra are expected and exactly one completion finishes it.
        for id in &ids {
            c.expect(id, 999);
        }
        let finished: Vec<_> = (0..4)
            .map(|_| {
                let (c, ids) = (Arc::clone(&c), ids.clone());
                std::thread::spawn(move || {
                    let mut done = 0;
                    for _ in 0..250 {
                        for id in &ids {
                            done += usize::from(c.complete(id));
                        }
                    }
                    done
                })
            })
            .collect();
        let total: usize = finished.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(total, ids.len());
        assert!(c.is_empty());
    }

    proptest! {
        /// With k savers, a request is reported exactly once, on the k-th
        /// completion, whatever the interleaving of requests.
        #[test]
        fn reported_once_after_all_completions(ks in proptest::collection::vec(1u32..5, 1..6),
                                               seed in any::<u64>()) {
            let c = SaveCountdown::new();
            let mut events = Vec::new();
            for (i, &k) in ks.iter().enumerate() {
                c.expect(&i.to_string(), k - 1);
                events.extend(std::iter::repeat_n(i, k as usize));
            }
            // deterministic shuffle
            let mut s = seed | 1;
            for i in (1..events.len()).rev() {
                s ^= s << 13; s ^= s >> 7; s ^= s << 17;
                events.swap(i, (s % (i as u64 + 1)) as usize);
            }
            let mut seen = vec![0u32; ks.len()];
            for e in events {
                seen[e] += 1;
                let fin = c.complete(&e.to_string());
                prop_assert_eq!(fin, seen[e] == ks[e]);
            }
            prop_assert!(c.is_empty());
        }
    }
}
