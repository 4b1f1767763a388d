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
        // The usual configuration and moment: no deadline, not `compose`,
        // no breaker open or counting failures, no request with a child
        // out of its lookups. Then every child is asked the same and no
        // breaker needs telling of an answer, so none of the bookkeeping
        // below can matter (one snapshot of the flags, read once).
        if !self.any_deadline
            && self.load != LoadPolicy::Compose
            && self.breakers.quiet()
            && !self.table.any_excluded()
        {
            return self.lookup_plain(req_id, num_computed_tokens, ask);
        }
        self.lookup_full(req_id, num_computed_tokens, ask)
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
        self.count_lookup(&got, &matches);
        Ok(Looked {
            lookup: got,
            contained,
        })
    }

    /// [`SchedulerMux::lookup`] with deadlines, breakers, exclusions and `compose`.
    pub(super) fn lookup_full<E>(
        &self,
        req_id: &str,
        num_computed_tokens: u64,
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
        if compose && got.tokens.is_some() {
            let spans = matches
                .iter()
                .map(|m| (m.tokens.unwrap_or(0), m.load_async))
                .collect();
            self.table.with_mut(req_id, |r| r.spans = Some(spans));
        }
        self.count_lookup(&got, matches);
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
