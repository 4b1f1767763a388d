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
//!   [`crate::mux::SchedulerMux::finish`]); a child reporting it twice counts once;
//! - a receive: when the child that loads the request reports it (each of
//!   them, when several load spans of it under `compose`); if any of them
//!   reported its load failed, the request is reported failed too, once the
//!   last one reported ([`Verdict::Failed`]: vLLM then recomputes it);
//! - a completion from a child that owes nothing for the request (a
//!   duplicate, one it never saved or loaded, one whose failure on the
//!   request was contained) is a [`Verdict::Stray`]: dropped, for the
//!   caller to count;
//! - a load past its child's deadline ([`Completions::expire_recvs`]): the
//!   child no longer owes it and the load is failed for the request (so
//!   vLLM recomputes it, or fails it, by its `kv_load_failure_policy`); the
//!   child's completion of it, whenever it comes, is a stray, even when a
//!   new load of the same request by the same child is waited for by then
//!   (a late completion is told from a new one: the first one the child
//!   reports after the deadline is the late one).

use dashmap::{mapref::entry::Entry, DashMap};
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::{Duration, Instant};
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

/// How long a late completion of a timed-out load is waited for, to drop
/// it: past this the child is taken to have lost the transfer (a child
/// that reports one later still has it dropped when no load of that
/// request by that child is waited for then).
pub const LATE_HORIZON: Duration = Duration::from_secs(3600);

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
    /// A receive: some loader reported its load failed (or missed its
    /// deadline).
    failed: bool,
    /// A receive: when the workers heard of the load (None: no loader has
    /// a deadline).
    since: Option<Instant>,
}

/// The completions a worker waits for.
#[derive(Debug, Default)]
pub struct Completions {
    sends: DashMap<String, Owed, Xxh3DefaultBuilder>,
    recvs: DashMap<String, Owed, Xxh3DefaultBuilder>,
    /// Loads past their deadline: request id -> (bit set of the children
    /// whose late completion is still to be dropped, when they missed it).
    late: DashMap<String, (u64, Instant), Xxh3DefaultBuilder>,
    n_late: AtomicUsize,
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
                    since: None,
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
        self.expect_recv_since(req_id, children, None);
    }

    /// [`Completions::expect_recv`], the load's clock started at `since`
    /// (for [`Completions::expire_recvs`]).
    pub fn expect_recv_since(&self, req_id: &str, children: u64, since: Option<Instant>) {
        if children != 0 {
            let need = children.count_ones();
            let owed = Owed {
                children,
                need,
                failed: false,
                since,
            };
            self.recvs.insert(req_id.to_owned(), owed);
        }
    }

    /// Every load some child of which still owes its completion
    /// `deadlines[child]` or longer after the load began (`now`): that
    /// child no longer owes it, its late completion will be dropped, and
    /// the load is failed. `on(req_id, late_children, done)` gets each such
    /// request, `done` when no other loader owes it any more (report it
    /// finished and failed receiving now).
    pub fn expire_recvs(
        &self,
        deadlines: &[Option<Duration>],
        now: Instant,
        mut on: impl FnMut(&str, u64, bool),
    ) {
        let mut hit: Vec<(String, u64, bool)> = Vec::new();
        for mut e in self.recvs.iter_mut() {
            let Some(since) = e.since else { continue };
            let waited = now.saturating_duration_since(since);
            let mut late = 0u64;
            let mut owing = e.children;
            while owing != 0 {
                let i = owing.trailing_zeros() as usize;
                owing &= owing - 1;
                if deadlines
                    .get(i)
                    .copied()
                    .flatten()
                    .is_some_and(|d| waited >= d)
                {
                    late |= 1u64 << i;
                }
            }
            if late == 0 {
                continue;
            }
            e.children &= !late;
            e.need = e.need.saturating_sub(late.count_ones());
            e.failed = true;
            hit.push((e.key().clone(), late, e.need == 0));
        }
        for (req_id, late, done) in &hit {
            if *done {
                self.recvs.remove_if(req_id, |_, o| o.need == 0);
            }
            match self.late.entry(req_id.clone()) {
                Entry::Vacant(v) => {
                    v.insert((*late, now));
                    self.n_late.fetch_add(1, Relaxed);
                }
                Entry::Occupied(mut o) => {
                    let t = o.get_mut();
                    *t = (t.0 | late, now);
                }
            }
            on(req_id, *late, *done);
        }
        if self.n_late.load(Relaxed) > 0 {
            let before = self.late.len();
            self.late
                .retain(|_, (_, t)| now.saturating_duration_since(*t) < LATE_HORIZON);
            self.n_late
                .fetch_sub(before.saturating_sub(self.late.len()), Relaxed);
        }
    }

    /// `child`'s completion of `req_id` is the late one of a load it
    /// missed the deadline of: taken (true) once.
    fn take_late(&self, child: usize, req_id: &str) -> bool {
        if self.n_late.load(Relaxed) == 0 {
            return false;
        }
        let bit = 1u64.checked_shl(child as u32).unwrap_or(0);
        let Some(mut t) = self.late.get_mut(req_id) else {
            return false;
        };
        if t.0 & bit == 0 {
            return false;
        }
        t.0 &= !bit;
        drop(t);
        if self.late.remove_if(req_id, |_, t| t.0 == 0).is_some() {
            self.n_late.fetch_sub(1, Relaxed);
        }
        true
    }

    /// Timed-out loads whose late completion is still to be dropped.
    pub fn pending_late(&self) -> usize {
        self.n_late.load(Relaxed)
    }

    /// `child` reported `req_id` finished sending.
    pub fn sent(&self, child: usize, req_id: &str) -> Verdict {
        Self::complete(&self.sends, child, req_id, false)
    }

    /// `child` reported `req_id` finished receiving, its load `failed` or
    /// not.
    pub fn received(&self, child: usize, req_id: &str, failed: bool) -> Verdict {
        if self.take_late(child, req_id) {
            return Verdict::Stray;
        }
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

    fn ms(n: u64) -> Option<Duration> {
        Some(Duration::from_millis(n))
    }

    /// Runs `expire_recvs` at `now`: (request, late children, done) each.
    fn expire(
        c: &Completions,
        deadlines: &[Option<Duration>],
        now: Instant,
    ) -> Vec<(String, u64, bool)> {
        let mut out = Vec::new();
        c.expire_recvs(deadlines, now, |r, late, done| {
            out.push((r.to_owned(), late, done))
        });
        out
    }

    #[test]
    fn a_load_past_its_deadline_fails_once_and_its_late_completion_is_a_stray() {
        let c = Completions::new();
        let t0 = Instant::now();
        c.expect_recv_since("r", 0b10, Some(t0));
        let deadlines = [None, ms(100)];
        assert!(expire(&c, &deadlines, t0 + Duration::from_millis(99)).is_empty());
        assert_eq!(c.pending_recvs(), 1, "within its deadline it still waits");
        let hit = expire(&c, &deadlines, t0 + Duration::from_millis(100));
        assert_eq!(hit, vec![("r".to_owned(), 0b10, true)]);
        assert_eq!(c.pending_recvs(), 0);
        assert!(
            expire(&c, &deadlines, t0 + Duration::from_secs(9)).is_empty(),
            "failed once"
        );
        assert_eq!(c.pending_late(), 1);
        assert_eq!(
            c.received(1, "r", false),
            Verdict::Stray,
            "the late completion"
        );
        assert_eq!(c.pending_late(), 0);
        assert_eq!(c.received(1, "r", false), Verdict::Stray);
    }

    #[test]
    fn the_late_completion_never_finishes_a_new_load_of_the_request() {
        let c = Completions::new();
        let t0 = Instant::now();
        c.expect_recv_since("r", 0b1, Some(t0));
        assert_eq!(
            expire(&c, &[ms(10)], t0 + Duration::from_millis(10)).len(),
            1
        );
        // vLLM recomputes; the same child is chosen to load it again.
        c.expect_recv_since("r", 0b1, Some(t0 + Duration::from_millis(20)));
        assert_eq!(
            c.received(0, "r", false),
            Verdict::Stray,
            "the first load's, late"
        );
        assert_eq!(c.pending_recvs(), 1, "the new load still waits");
        assert_eq!(c.received(0, "r", false), Verdict::Done, "the new load's");
    }

    #[test]
    fn a_timed_out_span_fails_the_request_once_the_other_loaders_reported() {
        let c = Completions::new();
        let t0 = Instant::now();
        c.expect_recv_since("r", 0b11, Some(t0));
        let hit = expire(&c, &[None, ms(5)], t0 + Duration::from_millis(5));
        assert_eq!(
            hit,
            vec![("r".to_owned(), 0b10, false)],
            "child 0 still owes its span"
        );
        assert_eq!(c.received(0, "r", false), Verdict::Failed);
        assert_eq!(c.received(1, "r", false), Verdict::Stray);
        assert_eq!((c.pending_recvs(), c.pending_late()), (0, 0));
    }

    #[test]
    fn a_load_without_a_clock_or_a_deadline_waits_for_ever() {
        let c = Completions::new();
        let t0 = Instant::now();
        c.expect_recv("a", 0b1);
        c.expect_recv_since("b", 0b10, Some(t0));
        assert!(expire(&c, &[ms(0), None], t0 + Duration::from_secs(3600)).is_empty());
        assert_eq!(c.pending_recvs(), 2);
    }

    #[test]
    fn late_completions_never_reported_are_forgotten_after_the_horizon() {
        let c = Completions::new();
        let t0 = Instant::now();
        c.expect_recv_since("r", 0b1, Some(t0));
        expire(&c, &[ms(1)], t0 + Duration::from_millis(1));
        assert_eq!(c.pending_late(), 1);
        expire(&c, &[ms(1)], t0 + LATE_HORIZON + Duration::from_millis(1));
        assert_eq!(c.pending_late(), 0);
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
