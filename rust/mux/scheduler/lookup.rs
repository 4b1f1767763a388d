//! `get_num_new_matched_tokens`: [`SchedulerMux::lookup`] asks every child
//! (deadlines, breakers, `compose` spans) and chooses the loading child.

use super::*;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Instant;

use smallvec::{smallvec, SmallVec};

use crate::error::{ChildFault, MuxError};
use crate::mux::breaker::Outcome;
use crate::mux::notice::{self, Notice};
use crate::mux::requests::{all_children, Asked, ChildMatch, LoadPolicy, Lookup};

impl SchedulerMux {
    /// What to log after a lookup of `req_id`: each failure it contained,
    /// and every breaker transition since the last lookup.
    pub fn lookup_notices<E: std::fmt::Display>(
        &self,
        req_id: &str,
        contained: &[Contained<E>],
    ) -> Vec<Notice> {
        let mut out = self.exit_notices(req_id, contained, &[]);
        for t in self.breakers.take_transitions() {
            out.push(notice::transition(self.name(t.child), &t));
        }
        out
    }

    /// The child chosen to load a request, if any.
    pub fn chosen(&self, req_id: &str) -> Option<usize> {
        self.table.chosen(req_id)
    }

    /// `get_num_new_matched_tokens`: every child's answer (`ask(i)`) in, the
    /// multiplexer's out. The loading child is chosen by the load policy and
    /// remembered; a lookup that is not ready keeps the earlier choice; every
    /// child takes part.
    ///
    /// A child is out of the request's lookups (a miss, not asked again)
    /// once it missed its deadline, raised while it has a breaker (the
    /// failure is returned, contained, for the caller to log), or was
    /// skipped by its open breaker. Any other failing or malformed answer
    /// drops the request's state and names the child.
    pub fn lookup<E>(
        &self,
        req_id: &str,
        num_computed_tokens: u64,
        ask: impl FnMut(usize, u64) -> Result<ChildMatch, ChildFault<E>>,
    ) -> Result<Looked<E>, MuxError<E>> {
        self.lookup_about(req_id, num_computed_tokens, None, ask)
    }

    /// [`SchedulerMux::lookup`] with what the request says of itself
    /// (`about`: read when [`SchedulerMux::measuring`]), for the load
    /// decision and the timeline ([`super::decision`]).
    pub fn lookup_about<E>(
        &self,
        req_id: &str,
        num_computed_tokens: u64,
        about: Option<About>,
        ask: impl FnMut(usize, u64) -> Result<ChildMatch, ChildFault<E>>,
    ) -> Result<Looked<E>, MuxError<E>> {
        // The usual configuration and moment: no deadline, not `compose`,
        // no breaker open or counting failures, no request with a child
        // out of its lookups. Then every child is asked the same and no
        // breaker needs telling of an answer, so none of the bookkeeping
        // below can matter (one snapshot of the flags, read once).
        if !self.any_deadline
            && self.load != LoadPolicy::Compose
            && self.breakers.quiet()
            && !self.table.any_excluded()
            && self.measure.is_none()
        {
            return self.lookup_plain(req_id, num_computed_tokens, ask);
        }
        self.lookup_full(req_id, num_computed_tokens, about, ask)
    }

    /// [`SchedulerMux::lookup`] when nothing but the answers matters: every child
    /// asked for the tokens after `num_computed_tokens`, no deadline, no
    /// breaker admit or record (a raising child is still contained by its
    /// breaker, which then leaves this path for the next lookups).
    #[inline]
    pub(super) fn lookup_plain<E>(
        &self,
        req_id: &str,
        num_computed_tokens: u64,
        mut ask: impl FnMut(usize, u64) -> Result<ChildMatch, ChildFault<E>>,
    ) -> Result<Looked<E>, MuxError<E>> {
        let n = self.names.len();
        let mut matches: PerChild<ChildMatch> = SmallVec::new();
        let mut contained = Vec::new();
        let mut excluded = 0u64;
        for i in 0..n {
            let m = match ask(i, num_computed_tokens) {
                Ok(m) if !(m.load_async && m.tokens == Some(0)) => m,
                Ok(_) => return Err(self.malformed_lookup(i, req_id)),
                Err(fault) => {
                    contained.push(self.lookup_raised(i, req_id, fault)?);
                    excluded |= 1u64 << i;
                    MISS
                }
            };
            matches.push(m);
        }
        let who = Asked {
            since: None,
            excluded,
            asked: all_children(n),
        };
        let (got, before) =
            self.table
                .relookup_at(req_id, num_computed_tokens, self.load, &matches, who);
        if let Some(before) = before {
            self.admission_over(req_id, &before);
        }
        if got.tokens.is_some() {
            self.note_hits(req_id, &matches, all_children(n) & !excluded);
        }
        self.count_lookup(&got, &matches);
        Ok(Looked {
            lookup: got,
            contained,
        })
    }

    /// [`SchedulerMux::lookup`] with deadlines, breakers, exclusions,
    /// `compose`, the load decision and the timeline.
    pub(super) fn lookup_full<E>(
        &self,
        req_id: &str,
        num_computed_tokens: u64,
        about: Option<About>,
        mut ask: impl FnMut(usize, u64) -> Result<ChildMatch, ChildFault<E>>,
    ) -> Result<Looked<E>, MuxError<E>> {
        let unset = ChildMatch {
            tokens: None,
            load_async: false,
        };
        let mut matches: PerChild<ChildMatch> = smallvec![unset; self.names.len()];
        // Children already out of this request's lookups, and when it was
        // first looked up (for deadlines); read only when either can matter.
        let (now, since, mut excluded, took_part) =
            if self.any_deadline || self.breakers.any_tripped() || self.table.any_excluded() {
                let prev = self.table.get(req_id);
                let excluded = prev.map_or(0, |s| s.excluded);
                let took_part = prev.map_or(0, |s| s.took_part);
                if self.any_deadline {
                    let now = Instant::now();
                    let since = prev.and_then(|s| s.first_lookup).unwrap_or(now);
                    (Some(now), Some(since), excluded, took_part)
                } else {
                    (None, None, excluded, took_part)
                }
            } else {
                (None, None, 0, 0)
            };
        let mut contained = Vec::new();
        // The children asked (they take part in the request).
        let mut asked = 0u64;
        let compose = self.load == LoadPolicy::Compose;
        // `compose`: each child is asked for the tokens after the earlier
        // children's hits; the ones after a child that is not ready yet are
        // not asked this time (bits in `unasked`).
        let mut offset = 0u64;
        let mut unasked = 0u64;
        let mut stopped = false;
        for (i, slot) in matches.iter_mut().enumerate() {
            let bit = 1u64 << i;
            if stopped {
                unasked |= bit;
                continue;
            }
            if excluded & bit != 0 {
                *slot = MISS;
                continue;
            }
            if !self.breakers.admit(i, req_id) {
                *slot = MISS;
                excluded |= bit;
                if took_part & bit == 0 {
                    asked |= bit;
                }
                let mut interrupted = None;
                self.skipped(i, took_part & bit == 0, || {
                    match ask(i, num_computed_tokens.saturating_add(offset)) {
                        Ok(_) => true,
                        Err(ChildFault::Interrupt(e)) => {
                            interrupted = Some(e);
                            true
                        }
                        Err(_) => false,
                    }
                });
                if let Some(e) = interrupted {
                    self.forget(req_id);
                    return Err(MuxError::child(i, hook::LOOKUP, ChildFault::Interrupt(e)));
                }
                continue;
            }
            asked |= bit;
            match ask(i, num_computed_tokens.saturating_add(offset)) {
                Ok(m) if !(m.load_async && m.tokens == Some(0)) => {
                    *slot = m;
                    match m.tokens {
                        Some(t) => {
                            self.breakers.record(i, req_id, Outcome::Answered);
                            if compose {
                                offset = offset.saturating_add(t);
                            }
                        }
                        // The children after this one are not asked.
                        None if compose => stopped = true,
                        None => {}
                    }
                }
                Ok(_) => return Err(self.malformed_lookup(i, req_id)),
                Err(fault) => {
                    contained.push(self.lookup_raised(i, req_id, fault)?);
                    *slot = MISS;
                    excluded |= bit;
                }
            }
        }
        if let (Some(now), Some(since)) = (now, since) {
            for (i, slot) in matches.iter_mut().enumerate() {
                let late = self.deadlines[i].is_some_and(|d| now.duration_since(since) >= d);
                if slot.tokens.is_none() && late && unasked & (1u64 << i) == 0 {
                    *slot = MISS;
                    excluded |= 1u64 << i;
                    self.counters.child(i, Child::LookupTimeouts, 1);
                    self.failed(i, req_id);
                }
            }
        }
        let why = self.decide(
            req_id,
            num_computed_tokens,
            about,
            &mut matches,
            &mut excluded,
            unasked,
        );
        let matches = &matches[..];
        let (got, before) = self.table.relookup_at(
            req_id,
            num_computed_tokens,
            self.load,
            matches,
            Asked {
                since,
                excluded,
                asked,
            },
        );
        if let Some(before) = before {
            self.admission_over(req_id, &before);
        }
        if got.tokens.is_some() {
            self.note_hits(req_id, matches, asked & !unasked & !excluded);
        }
        if compose && got.tokens.is_some() {
            let spans = matches
                .iter()
                .map(|m| (m.tokens.unwrap_or(0), m.load_async))
                .collect();
            self.table.with_mut(req_id, |r| r.spans = Some(spans));
        }
        self.count_lookup(&got, matches);
        if self.measure.is_some() {
            self.note_lookup(
                req_id,
                num_computed_tokens,
                about,
                matches,
                &why,
                got.tokens.is_some(),
                asked & !unasked,
            );
        }
        Ok(Looked {
            lookup: got,
            contained,
        })
    }

    /// Count a lookup's answer: answered, and each child's hit.
    #[inline]
    pub(super) fn count_lookup(&self, got: &Lookup, matches: &[ChildMatch]) {
        if got.tokens.is_some() {
            self.counters.lookup_answered();
            for (i, m) in matches.iter().enumerate() {
                let toks = m.tokens.unwrap_or(0);
                if toks > 0 {
                    self.counters.child(i, Child::Hits, 1);
                    self.counters.child(i, Child::HitTokens, toks);
                }
            }
        }
    }

    /// Child i answered a lookup with an async load of 0 tokens: the
    /// request's state is dropped and the error names the child.
    #[cold]
    pub(super) fn malformed_lookup<E>(&self, i: usize, req_id: &str) -> MuxError<E> {
        let fault = ChildFault::Malformed("returned load_async=True with 0 tokens".into());
        self.forget(req_id);
        MuxError::child(i, hook::LOOKUP, fault)
    }

    /// Child i's breaker is open: it is skipped (a miss, not waited for).
    /// A child never asked about this request (`first`) is still told of it
    /// once (`ask`; its answer ignored): a child that keeps per-request
    /// state from its lookup (LMCache's) fails on a request it meets later
    /// without one.
    #[cold]
    pub(super) fn skipped(&self, i: usize, first: bool, ask: impl FnOnce() -> bool) {
        self.counters.child(i, Child::BreakerSkips, 1);
        if first && !ask() {
            self.counters.child(i, Child::LookupErrors, 1);
        }
    }

    /// Child i raised in a lookup of `req_id`: with a breaker, a contained
    /// miss (counted, told to the breaker, returned for the caller to log);
    /// without, the request's state is dropped and the error names it.
    #[cold]
    pub(super) fn lookup_raised<E>(
        &self,
        i: usize,
        req_id: &str,
        fault: ChildFault<E>,
    ) -> Result<Contained<E>, MuxError<E>> {
        if !matches!(fault, ChildFault::Raised(_)) || !self.breakers.has(i) {
            self.forget(req_id);
            return Err(MuxError::child(i, hook::LOOKUP, fault));
        }
        let bit = 1u64 << i;
        self.counters.child(i, Child::LookupErrors, 1);
        self.failed(i, req_id);
        Ok(Contained {
            child: i,
            hook: hook::LOOKUP,
            first: self.warned_lookup.fetch_or(bit, Relaxed) & bit == 0,
            fault,
        })
    }

    /// Child i failed a lookup of `req_id`: tell its breaker.
    pub(super) fn failed(&self, i: usize, req_id: &str) {
        if self.breakers.record(i, req_id, Outcome::Failed) {
            self.counters.child(i, Child::BreakerOpens, 1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::notice::{Kind, Level};
    use crate::mux::scheduler::test_support::*;

    fn with_deadlines(deadlines: Vec<Option<Duration>>) -> SchedulerMux {
        mux(deadlines.len(), ClashPolicy::Error, LoadPolicy::First)
            .with_lookup_deadlines::<String>(deadlines)
            .unwrap()
    }

    fn not_ready() -> R<ChildMatch> {
        Ok(ChildMatch {
            tokens: None,
            load_async: false,
        })
    }

    fn with_breaker(failures: u32, cooldown_ms: u64, deadline: Option<Duration>) -> SchedulerMux {
        let cfg = BreakerConfig {
            failures,
            cooldown: Duration::from_millis(cooldown_ms),
            max_cooldown: Duration::from_millis(cooldown_ms * 8),
        };
        with_deadlines(vec![deadline, None])
            .with_breakers::<String>(vec![Some(cfg), None])
            .unwrap()
    }

    fn raised() -> R<ChildMatch> {
        Err(ChildFault::Raised("server gone".into()))
    }

    fn count(m: &SchedulerMux, i: usize, c: Child) -> u64 {
        m.snapshot().children[i][c as usize]
    }

    #[test]
    fn lookup_chooses_by_policy_and_counts_hits() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::Longest);
        let got = m.lookup("r", 32, |i, _| hit([0, 16, 48][i])).unwrap();
        assert_eq!((got.tokens, got.chosen), (Some(48), Some(2)));
        assert_eq!(m.chosen("r"), Some(2));
        let snap = m.snapshot();
        assert_eq!(snap.children[0][Child::Lookups as usize], 1);
        assert_eq!(snap.children[0][Child::Hits as usize], 0);
        assert_eq!(snap.children[1][Child::HitTokens as usize], 16);
    }

    #[test]
    fn a_child_past_its_deadline_is_a_miss_and_never_asked_again() {
        let m = with_deadlines(vec![Some(Duration::ZERO), None]);
        let got = m
            .lookup("r", 0, |i, _| if i == 0 { not_ready() } else { hit(32) })
            .unwrap();
        assert_eq!((got.tokens, got.chosen), (Some(32), Some(1)));
        assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 1);
        // Its late answer never counts: it is not even asked.
        let again = m
            .lookup("r", 0, |i, _| {
                assert_ne!(i, 0, "a timed-out child is not asked again");
                hit(16)
            })
            .unwrap();
        assert_eq!((again.tokens, again.chosen), (Some(16), Some(1)));
        assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 1);
        // It still took part: its finish is called like any other's.
        let mut finished = vec![];
        m.finish_fns(
            "r",
            |_| hook::FINISHED,
            want(false),
            |_| false,
            own,
            |i| {
                finished.push(i);
                done(false, None)
            },
        )
        .unwrap();
        assert_eq!(finished, [0, 1]);
    }

    #[test]
    fn a_raising_child_with_a_breaker_is_a_contained_miss_for_that_request() {
        let m = with_breaker(5, 1000, None);
        let got = m
            .lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(32) })
            .unwrap();
        assert_eq!((got.tokens, got.chosen), (Some(32), Some(1)));
        assert_eq!(got.contained.len(), 1);
        let c = &got.contained[0];
        assert_eq!((c.child, c.hook, c.first), (0, hook::LOOKUP, true));
        assert_eq!(count(&m, 0, Child::LookupErrors), 1);
        // Not asked again for this request.
        m.lookup("r", 0, |i, _| {
            assert_ne!(i, 0);
            hit(32)
        })
        .unwrap();
        // The next failure is logged quietly.
        let next = m
            .lookup("s", 0, |i, _| if i == 0 { raised() } else { hit(0) })
            .unwrap();
        assert!(!next.contained[0].first);
        // Without a breaker, a raising child fails the call (see
        // lookup_fault_names_the_child_and_drops_state).
        assert!(m.forget("r") && m.forget("s"));
        assert!(!m.table.any_excluded(), "finishing clears the exclusions");
    }

    #[test]
    fn an_interrupt_is_never_contained() {
        // With a breaker a raising lookup is a contained miss; an interrupt
        // (Ctrl-C in a child) is handed back, and the request forgotten.
        let m = with_breaker(3, 1000, None);
        let err = m
            .lookup("r", 0, |i, _| {
                if i == 0 {
                    Err(ChildFault::Interrupt("KeyboardInterrupt".into()))
                } else {
                    hit(0)
                }
            })
            .unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                fault: ChildFault::Interrupt(_),
                ..
            }
        ));
        assert_eq!(m.live_requests(), 0);
        assert_eq!(count(&m, 0, Child::LookupErrors), 0);
        // On the way out, a child that never took part fails the call when
        // interrupted (a raise would be contained), after every child ran.
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let answers = vec![
            Err(ChildFault::Interrupt("SystemExit".into())),
            done(true, None),
        ];
        let err = finish_with(&m, "x", false, answers).unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                child: 0,
                fault: ChildFault::Interrupt(_),
                ..
            }
        ));
        assert_eq!(m.live_requests(), 0);
    }

    #[test]
    fn huge_composed_counts_saturate_instead_of_wrapping() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::Compose);
        let big = i64::MAX as u64;
        let got = m.lookup("r", 0, |i, _| hit([big, big, 5][i])).unwrap();
        assert_eq!(got.tokens, Some(u64::MAX));
    }

    #[test]
    fn consecutive_failures_open_the_breaker_and_skip_the_child() {
        let m = with_breaker(2, 30, Some(Duration::ZERO));
        // A request that waits on child 0 with a deadline not yet passed.
        for r in ["a", "b"] {
            m.lookup(r, 0, |i, _| if i == 0 { not_ready() } else { hit(0) })
                .unwrap();
        }
        assert_eq!(m.breaker(0), Some(State::Open));
        assert_eq!(m.breaker(1), None);
        assert_eq!(count(&m, 0, Child::BreakerOpens), 1);
        let t = m.take_breaker_transitions();
        assert_eq!(t.len(), 1);
        assert_eq!((t[0].child, t[0].to, t[0].failures), (0, State::Open, 2));
        assert_eq!(
            m.take_breaker_changes(),
            Some(vec![Some(State::Open), None])
        );
        // While open, a new request is not held by it: it is told of the
        // request once (a child may keep per-request state from its
        // lookup), its answer ignored, and not asked again.
        let mut asked = vec![];
        let got = m
            .lookup("c", 0, |i, _| {
                asked.push(i);
                if i == 0 {
                    not_ready()
                } else {
                    hit(16)
                }
            })
            .unwrap();
        assert_eq!((got.tokens, got.chosen), (Some(16), Some(1)));
        assert_eq!(count(&m, 0, Child::BreakerSkips), 1);
        m.lookup("c", 0, |i, _| {
            asked.push(i);
            hit(16)
        })
        .unwrap();
        assert_eq!(asked, [0, 1, 1], "told once, then not asked");
        // It takes part: it gets the allocation (0 tokens) and the finish.
        let mut told = vec![];
        m.allocated("c", 16, no_blocks, |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(told, [(0, 0), (1, 16)]);
        let mut finished = vec![];
        m.finish_fns(
            "c",
            |_| hook::FINISHED,
            want(false),
            |_| false,
            own,
            |i| {
                finished.push(i);
                done(false, None)
            },
        )
        .unwrap();
        assert_eq!(finished, [0, 1]);
        // A request that asked it before it opened still tells it.
        let mut told = vec![];
        m.allocated("a", 0, no_blocks, |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(told, [(0, 0), (1, 0)]);
        // After the cooldown one request probes it; its answer closes it.
        std::thread::sleep(Duration::from_millis(40));
        let mut asked = vec![];
        m.lookup("probe", 0, |i, _| {
            asked.push(i);
            hit(0)
        })
        .unwrap();
        assert_eq!(asked, [0, 1]);
        assert_eq!(m.breaker(0), Some(State::Closed));
        let to: Vec<State> = m.take_breaker_transitions().iter().map(|t| t.to).collect();
        assert_eq!(to, [State::HalfOpen, State::Closed]);
        for r in ["a", "b", "probe"] {
            assert!(m.forget(r));
        }
        assert_eq!(m.live_requests(), 0);
    }

    #[test]
    fn a_failed_probe_reopens_and_a_finished_probe_hands_it_on() {
        let m = with_breaker(1, 10, None);
        m.lookup("a", 0, |i, _| if i == 0 { raised() } else { hit(0) })
            .unwrap();
        assert_eq!(m.breaker(0), Some(State::Open));
        std::thread::sleep(Duration::from_millis(15));
        // The probe is not ready yet; another request skips the child.
        m.lookup("p", 0, |i, _| if i == 0 { not_ready() } else { hit(0) })
            .unwrap();
        assert_eq!(m.breaker(0), Some(State::HalfOpen));
        // Another request tells it once, but its answer does not count.
        m.lookup("q", 0, |i, _| hit(if i == 0 { 64 } else { 0 }))
            .unwrap();
        assert_eq!(
            m.breaker(0),
            Some(State::HalfOpen),
            "only the probe's answer counts"
        );
        // The probe ends unanswered: the next request probes.
        finish_with(&m, "p", false, vec![done(false, None), done(false, None)]).unwrap();
        m.lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(0) })
            .unwrap();
        assert_eq!(m.breaker(0), Some(State::Open));
        let opened: Vec<u128> = m
            .take_breaker_transitions()
            .iter()
            .filter_map(|t| t.cooldown)
            .map(|d| d.as_millis())
            .collect();
        assert_eq!(opened, [10, 20], "a failed probe doubles the cooldown");
        for r in ["a", "q", "r"] {
            assert!(m.forget(r));
        }
        assert!(!m.table.any_excluded());
    }

    #[test]
    fn within_its_deadline_a_not_ready_child_keeps_the_request_waiting() {
        let hour = Some(Duration::from_secs(3600));
        let m = with_deadlines(vec![hour, None]);
        let got = m
            .lookup("r", 0, |i, _| if i == 0 { not_ready() } else { hit(32) })
            .unwrap();
        assert_eq!(got.tokens, None);
        assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 0);
        // A child without a deadline waits for ever, whatever the others'.
        let m = with_deadlines(vec![None, Some(Duration::ZERO)]);
        let got = m.lookup("r", 0, |_, _| not_ready()).unwrap();
        assert_eq!(got.tokens, None);
        assert_eq!(m.snapshot().children[1][Child::LookupTimeouts as usize], 1);
    }

    #[test]
    fn the_deadline_runs_from_the_first_lookup() {
        let m = with_deadlines(vec![Some(Duration::from_millis(30))]);
        assert_eq!(m.lookup("r", 0, |_, _| not_ready()).unwrap().tokens, None);
        std::thread::sleep(Duration::from_millis(40));
        assert_eq!(
            m.lookup("r", 0, |_, _| not_ready()).unwrap().tokens,
            Some(0)
        );
    }

    #[test]
    fn lookup_over_many_children_chooses_among_all() {
        let m = mux(MAX_CHILDREN, ClashPolicy::Error, LoadPolicy::Longest);
        let got = m
            .lookup("r", 0, |i, _| {
                hit(if i == MAX_CHILDREN - 1 { 64 } else { 16 })
            })
            .unwrap();
        assert_eq!((got.tokens, got.chosen), (Some(64), Some(MAX_CHILDREN - 1)));
    }

    #[test]
    fn not_ready_lookup_counts_nothing_and_keeps_the_choice() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        let got = m
            .lookup("r", 0, |i, _| -> R<ChildMatch> {
                Ok(ChildMatch {
                    tokens: (i == 0).then_some(16),
                    load_async: false,
                })
            })
            .unwrap();
        assert_eq!(got.tokens, None);
        assert_eq!(m.chosen("r"), Some(0));
        assert_eq!(m.snapshot().children[0][Child::Lookups as usize], 1);
    }

    #[test]
    fn lookup_fault_names_the_child_and_drops_state() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        let err = m
            .lookup("r", 0, |i, _| {
                if i == 1 {
                    Err(ChildFault::Raised("boom".to_owned()))
                } else {
                    hit(0)
                }
            })
            .unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                child: 1,
                hook: hook::LOOKUP,
                ..
            }
        ));
        assert_eq!(m.live_requests(), 0);
    }

    #[test]
    fn load_async_with_zero_tokens_is_malformed() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        let err = m
            .lookup("r", 0, |_, _| -> R<ChildMatch> {
                Ok(ChildMatch {
                    tokens: Some(0),
                    load_async: true,
                })
            })
            .unwrap_err();
        match err {
            MuxError::Child {
                fault: ChildFault::Malformed(why),
                ..
            } => assert!(why.contains("load_async=True with 0 tokens")),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn notices_tell_each_contained_failure_clash_and_breaker_transition_once() {
        // A breaker opens on the first raising lookup: the lookup's notices
        // are the contained miss (loud, the child's first) and the opening.
        let m = with_breaker(1, 60_000, None);
        let got = m
            .lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(0) })
            .unwrap();
        let notices = m.lookup_notices("r", &got.contained);
        let kinds: Vec<_> = notices.iter().map(|n| (n.kind, n.level)).collect();
        assert_eq!(
            kinds,
            [
                (Kind::LookupMiss, Level::Warning),
                (Kind::BreakerOpened, Level::Warning)
            ]
        );
        assert!(notices[0].text.contains("contained as a miss"));
        assert!(notices[1].text.contains("breaker of child 'c0' opened"));
        assert!(
            m.lookup_notices::<String>("s", &[]).is_empty(),
            "a transition is told once"
        );
        // A clash resolved by the policy, told once per key.
        let m = mux(2, ClashPolicy::First, LoadPolicy::First);
        let a = || done(false, Some(P(vec![("k", 1)])));
        let f = finish_with(&m, "r", false, vec![a(), a()]).unwrap();
        let notices = m.exit_notices("r", &f.contained, &f.new_clashes);
        assert_eq!(notices.len(), 1);
        assert!(notices[0]
            .text
            .contains("'c0' and 'c1' both return kv_transfer_params key 'k'"));
        let f = finish_with(&m, "s", false, vec![a(), a()]).unwrap();
        assert!(m.exit_notices("s", &f.contained, &f.new_clashes).is_empty());
    }

    #[test]
    fn compose_asks_each_child_after_the_earlier_ones_and_splits_the_load() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::Compose);
        // Child 0 holds [16, 48), child 1 up to 80 (asked from 48), child 2 nothing.
        let mut asked = vec![];
        let got = m
            .lookup("r", 16, |i, nct| -> R<ChildMatch> {
                asked.push((i, nct));
                let held = [48, 80, 0][i];
                Ok(ChildMatch {
                    tokens: Some(held.max(nct) - nct),
                    load_async: i == 1,
                })
            })
            .unwrap();
        assert_eq!(asked, [(0, 16), (1, 48), (2, 80)]);
        assert_eq!(
            (got.tokens, got.chosen, got.load_async),
            (Some(64), Some(0), true)
        );
        let mut told = vec![];
        m.allocated("r", 64, no_blocks, |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(told, [(0, 32), (1, 32), (2, 0)]);
        assert_eq!(
            m.take_outbox().loads.get("r"),
            Some(&0b10),
            "child 1 loads async"
        );
        let s = supplied(&m, "r");
        assert_eq!(
            (s.by_child.to_vec(), s.extra, s.local),
            (vec![32, 32, 0], 64, 16)
        );
        assert_eq!(m.live_requests(), 0);
        assert!(
            m.table.with("r", |_| ()).is_none(),
            "its spans left with it"
        );
    }

    #[test]
    fn first_and_longest_ask_every_child_from_vllms_computed_tokens() {
        for policy in [LoadPolicy::First, LoadPolicy::Longest] {
            let m = mux(2, ClashPolicy::Error, policy);
            let mut asked = vec![];
            m.lookup("r", 16, |i, nct| {
                asked.push((i, nct));
                hit(32)
            })
            .unwrap();
            assert_eq!(asked, [(0, 16), (1, 16)], "{policy:?}");
        }
    }

    #[test]
    fn compose_waits_for_a_child_before_asking_the_ones_after_it() {
        let m = with_deadlines(vec![None, None]);
        let m = SchedulerMux {
            load: LoadPolicy::Compose,
            ..m
        };
        let got = m
            .lookup("r", 0, |i, _| {
                assert_eq!(i, 0, "child 1 is asked once child 0 answered");
                not_ready()
            })
            .unwrap();
        assert_eq!(got.tokens, None);
        let mut asked = vec![];
        let got = m
            .lookup("r", 0, |i, nct| {
                asked.push((i, nct));
                hit(16)
            })
            .unwrap();
        assert_eq!(asked, [(0, 0), (1, 16)]);
        assert_eq!(got.tokens, Some(32));
    }
}
