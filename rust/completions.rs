//! Worker-side completions, each with the identity of the child that
//! reported it.
//!
//! vLLM waits for a request's "finished sending" when the connector said it
//! saves asynchronously, and for its "finished receiving" when it loads
//! asynchronously; it trusts every id it is given, and one it does not
//! expect (a duplicate, a stale id, a request already freed) corrupts its
//! bookkeeping or crashes the scheduler (vllm#53049). So the scheduler side
//! tells the workers, with the next step's metadata, which children owe a
//! completion for which request, and a worker reports a request to vLLM
//! only when the children it waits for have reported:
//!
//! - a send: when each child that saved the request has reported it (one of
//!   them for a request the multiplexer never tracked, see
//!   [`crate::mux::Mux::finish`]); a child reporting it twice counts once;
//! - a receive: when the child that loads the request reports it (each of
//!   them, when several load spans of it under `compose`); if any of them
//!   reported its load failed, the request is reported failed too, once the
//!   last one reported ([`Verdict::Failed`]: vLLM then recomputes it);
//! - a completion from a child that owes nothing for the request (a
//!   duplicate, one it never saved or loaded, one whose failure on the
//!   request was contained) is a [`Verdict::Stray`]: dropped, for the
//!   caller to count.

use dashmap::{mapref::entry::Entry, DashMap};
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

/// What one child's completion of one request means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// The last completion the request waited for: report it to vLLM.
    Done,
    /// The same, for a receive one of whose loaders failed: report it to
    /// vLLM finished and failed receiving.
    Failed,
    /// Counted; other children still owe theirs.
    Waiting,
    /// The child owed nothing for the request: dropped.
    Stray,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Owed {
    /// Bit i: child i still owes its completion.
    children: u64,
    /// Completions still needed before the request is done.
    need: u32,
    /// A receive: some loader reported its load failed.
    failed: bool,
}

/// The completions a worker waits for.
#[derive(Debug, Default)]
pub struct Completions {
    sends: DashMap<String, Owed, Xxh3DefaultBuilder>,
    recvs: DashMap<String, Owed, Xxh3DefaultBuilder>,
}

impl Completions {
    pub fn new() -> Self {
        Self::default()
    }

    /// Request `req_id` is saved asynchronously by the children in the bit
    /// set `children`; it is done after `need` of them reported (at least
    /// one, at most all).
    pub fn expect_send(&self, req_id: &str, children: u64, need: u32) {
        if children == 0 {
            return;
        }
        let need = need.clamp(1, children.count_ones());
        match self.sends.entry(req_id.to_owned()) {
            Entry::Vacant(e) => {
                e.insert(Owed {
                    children,
                    need,
                    failed: false,
                });
            }
            // Finished again before the first save ended (vLLM reuses an id):
            // wait for both.
            Entry::Occupied(mut e) => {
                let owed = e.get_mut();
                let new = children & !owed.children;
                owed.children |= children;
                owed.need += new.count_ones().min(need);
            }
        }
    }

    /// Request `req_id` is loaded asynchronously by the children in the bit
    /// set `children` (one, or several spans under `compose`); it is done
    /// when each reported it. A new load of the request replaces the last.
    pub fn expect_recv(&self, req_id: &str, children: u64) {
        if children != 0 {
            let need = children.count_ones();
            let owed = Owed {
                children,
                need,
                failed: false,
            };
            self.recvs.insert(req_id.to_owned(), owed);
        }
    }

    /// `child` reported `req_id` finished sending.
    pub fn sent(&self, child: usize, req_id: &str) -> Verdict {
        Self::complete(&self.sends, child, req_id, false)
    }

    /// `child` reported `req_id` finished receiving, its load `failed` or
    /// not.
    pub fn received(&self, child: usize, req_id: &str, failed: bool) -> Verdict {
        Self::complete(&self.recvs, child, req_id, failed)
    }

    fn complete(
        map: &DashMap<String, Owed, Xxh3DefaultBuilder>,
        child: usize,
        req_id: &str,
        failed: bool,
    ) -> Verdict {
        let bit = 1u64.checked_shl(child as u32).unwrap_or(0);
        let Some(mut owed) = map.get_mut(req_id) else {
            return Verdict::Stray;
        };
        if owed.children & bit == 0 {
            return Verdict::Stray;
        }
        owed.children &= !bit;
        owed.need -= 1;
        owed.failed |= failed;
        if owed.need > 0 {
            return Verdict::Waiting;
        }
        // Done: later completions are strays even before the entry goes.
        owed.children = 0;
        let failed = owed.failed;
        drop(owed);
        map.remove_if(req_id, |_, o| o.need == 0);
        if failed {
            Verdict::Failed
        } else {
            Verdict::Done
        }
    }

    /// Requests still waiting for send completions.
    pub fn pending_sends(&self) -> usize {
        self.sends.len()
    }

    /// Requests still waiting for their load's completion.
    pub fn pending_recvs(&self) -> usize {
        self.recvs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    #[test]
    fn a_send_is_done_when_every_saver_reported_once() {
        let c = Completions::new();
        c.expect_send("r", 0b101, 2);
        assert_eq!(c.sent(0, "r"), Verdict::Waiting);
        assert_eq!(c.sent(0, "r"), Verdict::Stray, "a duplicate counts once");
        assert_eq!(c.sent(1, "r"), Verdict::Stray, "child 1 never saved it");
        assert_eq!(c.sent(2, "r"), Verdict::Done);
        assert_eq!(
            c.sent(2, "r"),
            Verdict::Stray,
            "a late duplicate is dropped"
        );
        assert_eq!(c.pending_sends(), 0);
    }

    #[test]
    fn an_unannounced_completion_is_a_stray() {
        let c = Completions::new();
        assert_eq!(c.sent(0, "never"), Verdict::Stray);
        assert_eq!(c.received(0, "never", false), Verdict::Stray);
    }

    #[test]
    fn need_one_is_done_at_the_first_saver_and_the_rest_are_strays() {
        let c = Completions::new();
        c.expect_send("r", 0b11, 1);
        assert_eq!(c.sent(1, "r"), Verdict::Done);
        assert_eq!(c.sent(0, "r"), Verdict::Stray);
        assert_eq!(c.pending_sends(), 0);
    }

    #[test]
    fn a_receive_counts_only_from_the_loading_child() {
        let c = Completions::new();
        c.expect_recv("r", 0b10);
        assert_eq!(c.received(0, "r", false), Verdict::Stray);
        assert_eq!(c.pending_recvs(), 1);
        assert_eq!(c.received(1, "r", false), Verdict::Done);
        assert_eq!(c.received(1, "r", false), Verdict::Stray);
        assert_eq!(c.pending_recvs(), 0);
    }

    #[test]
    fn a_composed_load_is_done_when_every_async_loader_reported() {
        let c = Completions::new();
        c.expect_recv("r", 0b101);
        assert_eq!(c.received(0, "r", false), Verdict::Waiting);
        assert_eq!(c.received(0, "r", false), Verdict::Stray);
        assert_eq!(c.received(2, "r", false), Verdict::Done);
        assert_eq!(c.pending_recvs(), 0);
    }

    #[test]
    fn a_failed_span_fails_the_request_once_every_loader_reported() {
        let c = Completions::new();
        c.expect_recv("r", 0b11);
        assert_eq!(c.received(0, "r", true), Verdict::Waiting);
        assert_eq!(c.pending_recvs(), 1, "still waits for the other loader");
        assert_eq!(c.received(0, "r", false), Verdict::Stray);
        assert_eq!(c.received(1, "r", false), Verdict::Failed);
        assert_eq!(c.pending_recvs(), 0);
        c.expect_recv("s", 0b11);
        assert_eq!(c.received(1, "s", false), Verdict::Waiting);
        assert_eq!(
            c.received(0, "s", true),
            Verdict::Failed,
            "the last one failed"
        );
        assert_eq!(
            c.received(2, "t", true),
            Verdict::Stray,
            "a failure nobody owed is dropped"
        );
        c.expect_recv("t", 0b1);
        assert_eq!(
            c.received(0, "t", false),
            Verdict::Done,
            "a new load starts clean"
        );
    }

    #[test]
    fn need_is_clamped_to_the_savers() {
        let c = Completions::new();
        c.expect_send("r", 0b1, 5);
        assert_eq!(c.sent(0, "r"), Verdict::Done);
        c.expect_send("s", 0, 1);
        assert_eq!(c.pending_sends(), 0, "nobody saves: nothing to wait for");
    }

    proptest! {
        /// Any interleaving of the savers' completions, with duplicates and
        /// strays mixed in, reports the request exactly once, after the last
        /// saver, and leaves nothing behind.
        #[test]
        fn done_exactly_once_after_every_saver(
            savers in 1u64..256,
            order in proptest::collection::vec(0usize..8, 0..40),
        ) {
            let c = Completions::new();
            c.expect_send("r", savers, savers.count_ones());
            let mut seen = 0u64;
            let mut done = 0;
            for child in order.iter().copied().chain(0..8) {
                let v = c.sent(child, "r");
                let owes = savers & !seen & (1 << child) != 0;
                if owes {
                    seen |= 1 << child;
                }
                match v {
                    Verdict::Done => {
                        prop_assert!(owes && seen == savers);
                        done += 1;
                    }
                    Verdict::Waiting => prop_assert!(owes && seen != savers),
                    Verdict::Stray => prop_assert!(!owes),
                    Verdict::Failed => prop_assert!(false, "a send never fails"),
                }
            }
            prop_assert_eq!(done, 1);
            prop_assert_eq!(c.pending_sends(), 0);
        }
    }

    #[test]
    fn concurrent_completions_finish_each_request_once() {
        let c = Arc::new(Completions::new());
        for r in 0..200 {
            c.expect_send(&format!("r{r}"), 0b1111, 4);
        }
        let handles: Vec<_> = (0..4)
            .map(|child| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    (0..200)
                        .filter(|r| c.sent(child, &format!("r{r}")) == Verdict::Done)
                        .count()
                })
            })
            .collect();
        let done: usize = handles.into_iter().map(|h| h.join().unwrap()).sum();
        assert_eq!(done, 200);
        assert_eq!(c.pending_sends(), 0);
    }
}
