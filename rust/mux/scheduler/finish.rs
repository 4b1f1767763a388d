//! `request_finished`, `request_finished_all_groups` and
//! `register_finished_partial_tail`: [`SchedulerMux::finish`] calls every
//! child on the request's way out, counts what it supplied and merges the
//! params; HMA routing and refusal.

use super::*;
use std::sync::atomic::Ordering::Relaxed;

use crate::error::{ChildFault, MuxError};
use crate::mux::hma::{Route, TooManyGroups};
use crate::mux::merge::{self, Clash, KeyRule, MergeError, Merged};
use crate::mux::notice::{self, Notice};

/// A finish hook's calls (`request_finished`, `request_finished_all_groups`):
/// what [`SchedulerMux::finish`] needs from its caller. The bindings
/// implement it over Python (they only convert and call); the tests over
/// plain Rust children.
pub trait FinishHooks {
    type Params: Params;
    /// The hook child `i` gets (`request_finished` or
    /// `request_finished_all_groups`), to name it in errors.
    fn hook(&self, i: usize) -> &'static str;
    /// Whether the request itself asked for `key` (its `kv_transfer_params`
    /// hold it; the client chose which keys the children answer). Read only
    /// when two sources return one key.
    fn asked(&self, key: &str) -> bool;
    /// The multiplexer's own params, made from [`Supplied`] (called at most
    /// once, when the request wants some).
    fn own(&mut self, supplied: &Supplied) -> Result<Self::Params, ParamsError<Self::Params>>;
    /// Child `i`'s answer to its hook.
    fn call(
        &mut self,
        i: usize,
    ) -> ChildAnswer<ChildFinish<Self::Params>, ParamsError<Self::Params>>;
}

/// The error type of a [`Params`].
pub type ParamsError<P> = <P as Params>::Error;
/// A child's answer to a hook, or its fault.
pub type ChildAnswer<T, E> = Result<T, ChildFault<E>>;
/// What [`SchedulerMux::finish`] returns.
pub type FinishResult<P> =
    Result<Finished<P, <P as Params>::Value, ParamsError<P>>, MuxError<ParamsError<P>>>;
/// [`SchedulerMux::partial_tail`]'s answer: whether any child keeps the
/// blocks, and the failures it contained.
pub type PartialTail<E> = (bool, Vec<Contained<E>>);

/// A request's way out, child by child, for [`SchedulerMux::call_on_exit`].
pub(super) trait ExitCalls<E> {
    type Answer;
    /// The hook child `i` gets.
    fn hook(&self, i: usize) -> &'static str;
    fn call(&mut self, i: usize) -> ChildAnswer<Self::Answer, E>;
}

/// Several sources' params merged, and the resolved clashes to warn about.
type MergedParams<P> = (Vec<Merged<<P as Params>::Value>>, Vec<Clash>);

/// A finish hook's calls on the way out.
struct Finish<'a, H>(&'a mut H);

impl<H: FinishHooks> ExitCalls<ParamsError<H::Params>> for Finish<'_, H> {
    type Answer = ChildFinish<H::Params>;
    #[inline]
    fn hook(&self, i: usize) -> &'static str {
        self.0.hook(i)
    }
    #[inline]
    fn call(&mut self, i: usize) -> ChildAnswer<Self::Answer, ParamsError<H::Params>> {
        self.0.call(i)
    }
}

/// `register_finished_partial_tail`'s calls on the way out.
struct Tail<F>(F);

impl<E, F: FnMut(usize) -> ChildAnswer<bool, E>> ExitCalls<E> for Tail<F> {
    type Answer = bool;
    fn hook(&self, _: usize) -> &'static str {
        hook::PARTIAL_TAIL
    }
    fn call(&mut self, i: usize) -> ChildAnswer<bool, E> {
        (self.0)(i)
    }
}

impl SchedulerMux {
    /// vLLM's `request_finished_all_groups` of a request holding KV in
    /// `groups` cache groups: which hook each child gets, with which blocks
    /// ([`Hma::route`]). A request that children without HMA cannot take
    /// (several groups) must be refused ([`SchedulerMux::refuse`]): never
    /// truncated to one group.
    #[inline]
    pub fn finish_route(&self, groups: usize) -> Result<Route<'_>, TooManyGroups> {
        self.hma.route(groups)
    }

    /// Refuse `req_id`'s finish ([`SchedulerMux::finish_route`]'s error):
    /// its state is dropped and the error names the children that lack HMA.
    #[cold]
    pub fn refuse<E>(&self, req_id: &str, e: TooManyGroups) -> MuxError<E> {
        self.forget(req_id);
        MuxError::TooManyGroups {
            request: req_id.to_owned(),
            groups: e.groups,
            children: e.children,
        }
    }

    /// The message of [`MuxError::TooManyGroups`]: the request, its groups,
    /// the children that lack HMA, and the fixes.
    pub fn refusal(&self, request: &str, groups: usize, children: &[usize]) -> String {
        let e = TooManyGroups {
            groups,
            children: children.to_vec(),
        };
        self.hma.refusal(request, &e, |i| self.name(i))
    }

    /// What to log after a request's finish or partial tail: each failure
    /// it contained and each clash it resolved on a key never warned about.
    pub fn exit_notices<E: std::fmt::Display>(
        &self,
        req_id: &str,
        contained: &[Contained<E>],
        clashes: &[Clash],
    ) -> Vec<Notice> {
        let mut out = Vec::new();
        for c in contained {
            out.push(notice::contained(self.name(c.child), req_id, c));
        }
        let policy = self.clash.as_str();
        for c in clashes {
            out.push(notice::clash(c, policy, |i| self.name(i)));
        }
        out
    }

    pub(super) fn release_probe(&self, req_id: &str) {
        if self.breakers.any_tripped() {
            self.breakers.release(req_id);
        }
    }

    /// A finish hook (`request_finished` or `request_finished_all_groups`;
    /// `hooks.hook(i)` names the one child `i` gets, `hooks.call(i)` is its
    /// answer: [`FinishHooks`]).
    ///
    /// Rules:
    /// - every child is called, even after one fails;
    /// - a child that never took part in the request (never looked up nor
    ///   allocated) and fails is *contained*: counted, reported in
    ///   [`Finished::contained`], treated as "no async save, no params", and
    ///   the workers are told to drop its completions of the request;
    /// - a child that took part and fails fails the call, naming it, after
    ///   every child was called; the request's state is dropped;
    /// - the request is saving asynchronously if any child says so; k > 1
    ///   such children make the workers wait for k - 1 extra completions,
    ///   but only for a request the multiplexer tracked (an untracked one has
    ///   no blocks anyone saves, and a wait nobody ends would leak);
    /// - `want`: the multiplexer's own params (made by `hooks.own` from
    ///   [`Supplied`]: [`EXTRA_KEY`], the tokens the children supplied;
    ///   [`BY_CHILD_KEY`], those of each child and of the local prefix cache)
    ///   join the children's;
    /// - the tokens each child supplied and those of the local prefix cache
    ///   are counted (`served_tokens`, `local_cached_tokens`);
    /// - a single source of params is handed back uncopied; several are
    ///   merged under the clash policy, warning once per resolved key;
    /// - a clash is never an error on a key the request itself asked for
    ///   (`hooks.asked(key)`: the client chose which keys the children answer):
    ///   every source's value is kept, by source ([`KeyRule::PerSource`]);
    ///   nor on the multiplexer's own keys, where its value wins (a nested
    ///   kvmux answers them too). Both are counted as resolved clashes.
    ///
    /// The request's state is gone afterwards, whether this succeeds or not.
    pub fn finish<H: FinishHooks>(
        &self,
        req_id: &str,
        want: Want,
        hooks: &mut H,
    ) -> FinishResult<H::Params> {
        self.unwatch(req_id);
        // The answers are taken as they come (no vector of them): the
        // children saving asynchronously, and the params (a contained
        // child counts as neither).
        let mut savers = 0u64;
        let mut sources: Vec<(usize, H::Params)> = Vec::new();
        let contained = self.call_on_exit(req_id, &mut Finish(&mut *hooks), |i, ans| {
            if ans.async_save {
                savers |= 1u64 << i;
            }
            if let Some(p) = ans.params {
                sources.push((i, p));
            }
        })?;
        self.release_probe(req_id);
        // The request's whole state leaves with its one entry.
        let (seen, state, spans, credits) = match self.remove(req_id) {
            Some(mut r) => {
                // A child whose save was declined saves nothing of it: its
                // "saving asynchronously" is not waited for.
                savers &= !self.saves_finished(&mut r);
                self.note_finished(r.timeline);
                (true, r.state, r.spans, r.credits)
            }
            None => (false, RequestState::default(), None, None),
        };
        self.counters.total(Total::Finished, 1);
        let n_async = savers.count_ones();
        let mut bits = savers;
        while bits != 0 {
            self.counters
                .child(bits.trailing_zeros() as usize, Child::AsyncSaves, 1);
            bits &= bits - 1;
        }
        // Who supplied the loaded tokens: the chosen child, or under
        // `compose` each its span, in order (a failed load cut them from
        // the first bad block on).
        let mut by_child = self.split(spans.as_deref(), &state);
        let (mut loaded, mut local) = (state.loaded_tokens, state.local_hit_tokens);
        // Admitted more than once (preempted, or a failed async load
        // retried): each token is credited once, to the first source.
        if let Some(mut credits) = credits {
            if !state.looked {
                credits.add(state.local_hit_tokens, &by_child);
            }
            loaded = credits.by_child.iter().sum();
            local = credits.local;
            by_child = std::mem::take(&mut credits.by_child);
        }
        if seen {
            for (j, &t) in by_child.iter().enumerate().filter(|(_, &t)| t > 0) {
                self.counters.child(j, Child::ServedTokens, t);
            }
            self.counters.total(Total::LocalCachedTokens, local);
        }
        if want.any() {
            if want.extra {
                self.counters.total(Total::ExtraCachedTokens, loaded);
            }
            let supplied = Supplied {
                want,
                extra: loaded,
                by_child,
                local,
            };
            sources.push((
                self.names.len(),
                hooks.own(&supplied).map_err(MuxError::Host)?,
            ));
        }
        if n_async > 0 && state.load_pending {
            // Aborted while it waited for remote KV: vLLM frees the request
            // on its first completion, receive or send, and asserts on the
            // second; the load and the save both use its blocks until done.
            if self
                .joined
                .insert(req_id.to_owned(), RECV_DUE | SEND_DUE)
                .is_none()
            {
                self.n_joined.fetch_add(1, Relaxed);
            }
        }
        if n_async > 0 {
            let need = if seen { n_async } else { 1 };
            self.counters
                .total(Total::ExtraAsyncSaves, u64::from(need - 1));
            self.lock_outbox()
                .saves
                .insert(req_id.to_owned(), (savers, need));
        }
        let (params, new_clashes) = match sources.len() {
            0 => (None, Vec::new()),
            1 => (
                sources.pop().map(|(_, p)| FinishedParams::Source(p)),
                Vec::new(),
            ),
            _ => {
                let n = self.names.len();
                let rule = |key: &str| {
                    let own =
                        (want.extra && key == EXTRA_KEY) || (want.by_child && key == BY_CHILD_KEY);
                    if own {
                        KeyRule::Own(n)
                    } else if hooks.asked(key) {
                        KeyRule::PerSource
                    } else {
                        KeyRule::Policy
                    }
                };
                let (merged, warn) = self.merge(&*hooks, sources, rule)?;
                (Some(FinishedParams::Merged(merged)), warn)
            }
        };
        Ok(Finished {
            async_save: n_async > 0,
            params,
            new_clashes,
            contained,
        })
    }

    /// `register_finished_partial_tail`: true when any child keeps the
    /// request's blocks for a partial tail. Failures are contained as in
    /// [`SchedulerMux::finish`] (a contained child answers false).
    pub fn partial_tail<E>(
        &self,
        req_id: &str,
        call: impl FnMut(usize) -> ChildAnswer<bool, E>,
    ) -> Result<PartialTail<E>, MuxError<E>> {
        let mut any = false;
        let contained = self.call_on_exit(req_id, &mut Tail(call), |_, a| any |= a)?;
        Ok((any, contained))
    }

    /// Call every child for a request on its way out (see [`SchedulerMux::finish`]);
    /// each answer goes to `take(i, answer)` as it comes, a failed child's
    /// to nobody. Neither the answers nor their results are collected: the
    /// usual finish allocates nothing.
    pub(super) fn call_on_exit<E, C: ExitCalls<E>>(
        &self,
        req_id: &str,
        calls: &mut C,
        mut take: impl FnMut(usize, C::Answer),
    ) -> Result<Vec<Contained<E>>, MuxError<E>> {
        let n = self.names.len();
        // Read only when a child fails (the state is still in the table).
        let mut took_part = None;
        let mut contained = Vec::new();
        let mut error = None;
        for i in 0..n {
            match calls.call(i) {
                Ok(a) => take(i, a),
                Err(fault) => {
                    let part = *took_part
                        .get_or_insert_with(|| self.table.get(req_id).map_or(0, |s| s.took_part));
                    if part & (1u64 << i) != 0 || matches!(fault, ChildFault::Interrupt(_)) {
                        error.get_or_insert(MuxError::child(i, calls.hook(i), fault));
                    } else {
                        self.counters.child(i, Child::ContainedErrors, 1);
                        let bit = 1u64 << i;
                        let first = self.warned_contained.fetch_or(bit, Relaxed) & bit == 0;
                        contained.push(Contained {
                            child: i,
                            hook: calls.hook(i),
                            first,
                            fault,
                        });
                    }
                }
            }
        }
        if let Some(e) = error {
            self.forget(req_id);
            return Err(e);
        }
        Ok(contained)
    }

    /// Merge several sources' params under the clash policy; the resolved
    /// clashes whose key was never warned about are returned to warn about.
    pub(super) fn merge<H: FinishHooks>(
        &self,
        hooks: &H,
        sources: Vec<(usize, H::Params)>,
        rule: impl Fn(&str) -> KeyRule,
    ) -> Result<MergedParams<H::Params>, MuxError<ParamsError<H::Params>>> {
        let mut pairs = Vec::with_capacity(sources.len());
        for (i, p) in &sources {
            let kv = p.entries().map_err(|fault| match fault {
                ChildFault::Raised(e) | ChildFault::Interrupt(e) => MuxError::Host(e),
                malformed => MuxError::child(*i, hooks.hook(*i), malformed),
            })?;
            pairs.push((*i, kv));
        }
        match merge::merge_by(self.clash, pairs, rule) {
            Ok(out) => {
                self.counters
                    .total(Total::ClashesResolved, out.resolved.len() as u64);
                let warn = out
                    .resolved
                    .into_iter()
                    .filter(|c| self.warned_keys.insert(c.key.clone()))
                    .collect();
                Ok((out.entries, warn))
            }
            Err(MergeError::Compare(e)) => Err(MuxError::Host(e)),
            Err(MergeError::Clash(c)) => {
                self.counters.total(Total::ClashesRaised, 1);
                Err(MuxError::ParamClash {
                    key: c.key,
                    first: c.first,
                    second: c.second,
                    policy: self.clash.as_str(),
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::scheduler::test_support::*;
    use proptest::prelude::*;

    #[test]
    fn finish_reports_loaded_tokens_when_asked_and_passes_one_source_uncopied() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 16, |i, _| hit([0, 32][i])).unwrap();
        m.allocated("r", 32, no_blocks, no_tell).unwrap();
        let f = finish_with(&m, "r", true, vec![done(false, None), done(false, None)]).unwrap();
        assert_eq!(
            f.params,
            Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 32)])))
        );
        assert_eq!(m.live_requests(), 0);
        let one = P(vec![("remote", 1)]);
        let f = finish_with(
            &m,
            "s",
            false,
            vec![done(false, Some(one.clone())), done(false, None)],
        )
        .unwrap();
        assert_eq!(f.params, Some(FinishedParams::Source(one)));
        let f = finish_with(&m, "t", false, vec![done(false, None), done(false, None)]).unwrap();
        assert_eq!(f.params, None);
        assert_eq!(m.snapshot().totals[Total::Finished as usize], 3);
        assert_eq!(m.snapshot().totals[Total::ExtraCachedTokens as usize], 32);
    }

    #[test]
    fn several_async_savers_make_the_workers_wait_for_the_rest() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(0)).unwrap();
        let f = finish_with(
            &m,
            "r",
            false,
            vec![done(true, None), done(true, None), done(true, None)],
        )
        .unwrap();
        assert!(f.async_save);
        let out = m.take_outbox();
        assert_eq!(out.saves.get("r"), Some(&(0b111, 3)), "every saver reports");
        assert!(m.take_outbox().is_empty(), "taken once");
        assert_eq!(m.snapshot().totals[Total::ExtraAsyncSaves as usize], 2);
        assert_eq!(m.snapshot().children[2][Child::AsyncSaves as usize], 1);
    }

    #[test]
    fn untracked_request_never_waits_for_extra_saves() {
        // A request never looked up (aborted while waiting) or finished twice:
        // the first saver's completion ends it.
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let f = finish_with(&m, "x", false, vec![done(true, None), done(true, None)]).unwrap();
        assert!(f.async_save);
        assert_eq!(m.take_outbox().saves.get("x"), Some(&(0b11, 1)));
    }

    #[test]
    fn failure_of_a_child_that_never_took_part_is_contained() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let f = finish_with(
            &m,
            "x",
            true,
            vec![Err(ChildFault::Raised("tracker".into())), done(true, None)],
        )
        .unwrap();
        assert!(f.async_save);
        assert_eq!(f.contained.len(), 1);
        assert!(f.contained[0].first && f.contained[0].child == 0);
        assert_eq!(
            f.params,
            Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 0)])))
        );
        // The contained child is not among the savers: its completion of
        // the request will be a stray, dropped.
        assert_eq!(m.take_outbox().saves.get("x"), Some(&(0b10, 1)));
        let again = finish_with(
            &m,
            "y",
            false,
            vec![Err(ChildFault::Raised("tracker".into())), done(false, None)],
        )
        .unwrap();
        assert!(!again.contained[0].first, "loud once per child");
        assert_eq!(m.snapshot().children[0][Child::ContainedErrors as usize], 2);
    }

    #[test]
    fn failure_of_a_child_that_took_part_raises_after_calling_everyone() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(0)).unwrap();
        let mut called = vec![];
        let err = m
            .finish_fns(
                "r",
                |_| hook::FINISHED_ALL_GROUPS,
                want(false),
                |_| false,
                own,
                |i| {
                    called.push(i);
                    if i == 0 {
                        Err(ChildFault::Raised("x".to_owned()))
                    } else {
                        done(false, None)
                    }
                },
            )
            .unwrap_err();
        assert_eq!(called, [0, 1, 2]);
        assert!(matches!(
            err,
            MuxError::Child {
                child: 0,
                hook: hook::FINISHED_ALL_GROUPS,
                ..
            }
        ));
        assert_eq!(m.live_requests(), 0);
        assert!(m.take_outbox().is_empty());
    }

    #[test]
    fn clash_policies_on_finish() {
        let a = || done(false, Some(P(vec![("k", 1), ("a", 5)])));
        let b = || done(false, Some(P(vec![("k", 2)])));
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let err = finish_with(&m, "r", false, vec![a(), b()]).unwrap_err();
        assert!(
            matches!(err, MuxError::ParamClash { ref key, first: 0, second: 1, policy: "error" } if key == "k")
        );
        assert_eq!(m.snapshot().totals[Total::ClashesRaised as usize], 1);

        let m = mux(2, ClashPolicy::Last, LoadPolicy::First);
        let f = finish_with(&m, "r", false, vec![a(), b()]).unwrap();
        let Some(FinishedParams::Merged(merged)) = &f.params else {
            panic!("merged params expected");
        };
        let kv: Vec<_> = merged.iter().map(|e| (e.key.as_str(), &e.value)).collect();
        assert_eq!(kv, [("k", &V(2)), ("a", &V(5))]);
        assert_eq!(f.new_clashes.len(), 1);
        let f = finish_with(&m, "s", false, vec![a(), b()]).unwrap();
        assert!(f.new_clashes.is_empty(), "warned once per key");
        assert_eq!(m.snapshot().totals[Total::ClashesResolved as usize], 2);
    }

    #[test]
    fn a_multi_group_finish_with_a_child_without_hma_is_refused_and_forgotten() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_hma::<String>(vec![true, false])
            .unwrap();
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        assert_eq!(m.live_requests(), 1);
        let refused = m.finish_route(2).unwrap_err();
        let err = m.refuse::<String>("r", refused);
        let MuxError::TooManyGroups {
            ref request,
            groups,
            ref children,
        } = err
        else {
            panic!("refusal expected, got {err:?}");
        };
        assert_eq!(
            (request.as_str(), groups, children.as_slice()),
            ("r", 2, &[1][..])
        );
        assert_eq!(
            m.live_requests(),
            0,
            "the refused request's state is dropped"
        );
        assert!(m.refusal("r", 2, &[1]).contains("children ['c1']"));
        assert!(m.refusal("r", 2, &[1]).contains(crate::mux::hma::FIX));
        // One group: the child without HMA gets request_finished.
        let route = m.finish_route(1).unwrap();
        assert_eq!(
            (route.hook(0), route.hook(1)),
            (hook::FINISHED_ALL_GROUPS, hook::FINISHED)
        );
        assert!(mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_hma::<String>(vec![true])
            .is_err());
    }

    #[test]
    fn own_keys_win_over_a_childs_under_every_policy() {
        // A nested kvmux answers num_extra_cached_tokens too: the outer
        // multiplexer's count is the request's, never an error.
        for policy in [ClashPolicy::Error, ClashPolicy::Strict, ClashPolicy::First] {
            let m = mux(1, policy, LoadPolicy::First);
            let child = done(false, Some(P(vec![(EXTRA_KEY, 9), ("a", 1)])));
            let f = finish_with(&m, "r", true, vec![child]).unwrap();
            let Some(FinishedParams::Merged(merged)) = &f.params else {
                panic!("merged params expected");
            };
            let extra = merged.iter().find(|e| e.key == EXTRA_KEY).unwrap();
            assert_eq!((&extra.value, extra.source), (&V(0), 1));
            assert_eq!(f.new_clashes[0].rule, KeyRule::Own(1));
            assert_eq!(m.snapshot().totals[Total::ClashesRaised as usize], 0);
        }
        assert_eq!(
            mux(1, ClashPolicy::Error, LoadPolicy::First).name(1),
            "kvmux"
        );
    }

    #[test]
    fn a_clash_on_a_key_the_request_asked_for_is_answered_per_child_not_raised() {
        for policy in [ClashPolicy::Error, ClashPolicy::Strict] {
            let m = mux(2, policy, LoadPolicy::First);
            let a = done(false, Some(P(vec![("asked", 1)])));
            let b = done(false, Some(P(vec![("asked", 2)])));
            let f = finish_with(&m, "r", false, vec![a, b]).unwrap();
            let Some(FinishedParams::Merged(merged)) = &f.params else {
                panic!("merged params expected");
            };
            assert_eq!(merged.len(), 1);
            assert_eq!((&merged[0].value, merged[0].source), (&V(1), 0));
            assert_eq!(merged[0].others, vec![(1, V(2))]);
            assert_eq!(f.new_clashes.len(), 1, "logged once per key");
            let totals = m.snapshot().totals;
            assert_eq!(totals[Total::ClashesResolved as usize], 1);
            assert_eq!(totals[Total::ClashesRaised as usize], 0);
            assert_eq!(m.live_requests(), 0);
            // A key the request did not ask for still follows the policy.
            let a = done(false, Some(P(vec![("k", 1)])));
            let b = done(false, Some(P(vec![("k", 2)])));
            assert!(finish_with(&m, "s", false, vec![a, b]).is_err());
        }
    }

    #[test]
    fn malformed_params_name_the_child_and_failed_compare_is_the_hosts() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let bad = done(false, Some(P(vec![("", 1)])));
        let err = finish_with(&m, "r", false, vec![done(false, Some(P(vec![]))), bad]).unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                child: 1,
                fault: ChildFault::Malformed(_),
                ..
            }
        ));
        let neg = || done(false, Some(P(vec![("k", -1)])));
        let err = finish_with(&m, "s", false, vec![neg(), neg()]).unwrap_err();
        assert!(matches!(err, MuxError::Host(_)));
    }

    #[test]
    fn partial_tail_is_any_and_contains_like_finish() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let (keep, contained) = m
            .partial_tail("x", |i| {
                if i == 0 {
                    Err(ChildFault::Raised("x".to_owned()))
                } else {
                    Ok(true)
                }
            })
            .unwrap();
        assert!(keep);
        assert_eq!(contained.len(), 1);
        m.lookup("r", 0, |_, _| hit(0)).unwrap();
        let err = m
            .partial_tail("r", |_| Err(ChildFault::Raised("y".to_owned())))
            .unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                child: 0,
                hook: hook::PARTIAL_TAIL,
                ..
            }
        ));
    }

    proptest! {
        /// Whatever the children answer, a finished request leaves no state
        /// and the workers wait for exactly (savers - 1) extra completions.
        #[test]
        fn finish_always_cleans_up(savers in proptest::collection::vec(any::<bool>(), 1..8),
                                   looked_up in any::<bool>(),
                                   fail in proptest::option::of(0usize..8)) {
            let n = savers.len();
            let m = mux(n, ClashPolicy::Error, LoadPolicy::First);
            if looked_up {
                m.lookup("r", 0, |_, _| hit(0)).unwrap();
            }
            let res = m.finish_fns("r", |_| hook::FINISHED, want(false), |_| false, own, |i| {
                if Some(i) == fail { Err(ChildFault::Raised("x".to_owned())) }
                else { done(savers[i], None) }
            });
            prop_assert_eq!(m.live_requests(), 0);
            let out = m.take_outbox();
            let failed = fail.filter(|&f| f < n);
            match (res, failed) {
                (Err(_), Some(_)) => prop_assert!(looked_up && out.is_empty()),
                (Ok(f), _) => {
                    let k = savers.iter().enumerate()
                        .filter(|&(i, &s)| s && Some(i) != failed).count() as u32;
                    prop_assert_eq!(f.async_save, k > 0);
                    let savers: u64 = savers.iter().enumerate()
                        .filter(|&(i, &s)| s && Some(i) != failed)
                        .map(|(i, _)| 1u64 << i).sum();
                    let need = if looked_up { k } else { k.min(1) };
                    let want = (k > 0).then_some((savers, need));
                    prop_assert_eq!(out.saves.get("r").copied(), want);
                }
                (Err(e), None) => prop_assert!(false, "unexpected {:?}", e),
            }
        }
    }
}
