//! `update_state_after_alloc`: [`SchedulerMux::allocated`] tells each child
//! its share of the load; and each admission's crediting ([`Credits`]).

use super::*;

use crate::error::{ChildFault, MuxError};
use crate::mux::requests::{cut_spans, LoadPolicy, RequestState};

/// What the earlier admissions of a request (before a preemption, or before
/// a failed async load was retried) credited, token by token: its first
/// `covered` tokens went to vLLM's local prefix cache (`local`) or to a
/// child (`by_child`); a later admission credits only the tokens after them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Credits {
    pub covered: u64,
    pub local: u64,
    pub by_child: PerChild<u64>,
}

impl Credits {
    /// An admission's split: `local` tokens from vLLM's prefix cache, then
    /// each child's span in order. Only tokens past `covered` count.
    pub fn add(&mut self, local: u64, by_child: &[u64]) {
        let c = self.covered;
        if self.by_child.len() < by_child.len() {
            self.by_child.resize(by_child.len(), 0);
        }
        self.local += local.saturating_sub(c);
        let mut pos = local;
        for (j, &t) in by_child.iter().enumerate() {
            let end = pos.saturating_add(t);
            self.by_child[j] += end.saturating_sub(pos.max(c));
            pos = end;
        }
        self.covered = c.max(pos);
    }
}

impl SchedulerMux {
    /// The tokens each child supplied in the admission `st` (the chosen
    /// child's load, or under `compose` each child's span of `spans`, cut to
    /// what was loaded).
    pub(super) fn split(&self, spans: Option<&[(u64, bool)]>, st: &RequestState) -> PerChild<u64> {
        let mut by_child = zeros(self.names.len());
        match spans {
            Some(spans) => {
                let shares = cut_spans(spans.iter().map(|&(t, _)| t), st.loaded_tokens);
                for (j, share) in shares.enumerate() {
                    by_child[j] = share;
                }
            }
            None => {
                if let Some(i) = st.chosen.filter(|_| st.loaded_tokens > 0) {
                    by_child[i] = st.loaded_tokens;
                }
            }
        }
        by_child
    }

    /// A lookup begins a new admission of a request (`before`: its state
    /// at the end of the last one): that admission's split is credited.
    pub(super) fn admission_over(&self, req_id: &str, before: &RequestState) {
        let compose = self.load == LoadPolicy::Compose;
        self.table.with_mut(req_id, |r| {
            let spans = r.spans.as_deref().filter(|_| compose);
            let split = self.split(spans, before);
            r.credits
                .get_or_insert_with(Box::default)
                .add(before.local_hit_tokens, &split);
        });
    }

    /// `update_state_after_alloc`: the chosen child is told
    /// `num_external_tokens` (under `compose`, each child its span), every
    /// other child that took part 0 (`tell(i, n)`). A planned load's
    /// device blocks (`load_blocks(range)`: the request's blocks per KV
    /// cache group in the load's range of block indices, from the first
    /// after vLLM's own prefix) are watched for load errors when the model
    /// has one group:
    /// vLLM reports block-level load errors for single-group layouts only
    /// (several groups fail whole requests, `failed_recving`, which needs
    /// no blocks). A child failing drops the request's state.
    pub fn allocated<E>(
        &self,
        req_id: &str,
        num_external_tokens: u64,
        load_blocks: impl FnOnce(std::ops::Range<usize>) -> Result<Vec<Vec<u32>>, E>,
        mut tell: impl FnMut(usize, u64) -> Result<(), ChildFault<E>>,
    ) -> Result<Option<usize>, MuxError<E>> {
        let n = self.names.len();
        let (planned, took_part) = self.table.allocated(req_id, n, num_external_tokens);
        let chosen = planned.map(|(i, _)| i);
        // What each child loads: the chosen child all of it, or under
        // `compose` each its span (cut from the end to what vLLM allocated).
        let mut given = zeros(n);
        let mut async_loaders = 0u64;
        if let Some((i, load_async)) = planned {
            let composed = self.load == LoadPolicy::Compose
                && self
                    .table
                    .with(req_id, |r| {
                        let Some(spans) = r.spans.as_deref() else {
                            return false;
                        };
                        let shares = cut_spans(spans.iter().map(|&(t, _)| t), num_external_tokens);
                        for (j, share) in shares.enumerate() {
                            given[j] = share;
                            if share > 0 && spans[j].1 {
                                async_loaders |= 1u64 << j;
                            }
                        }
                        true
                    })
                    .unwrap_or(false);
            if !composed {
                given[i] = num_external_tokens;
                if load_async {
                    async_loaders = 1u64 << i;
                }
            }
            if async_loaders != 0 {
                self.table.load_started(req_id);
                self.lock_outbox()
                    .loads
                    .insert(req_id.to_owned(), async_loaders);
            }
            for (j, &g) in given.iter().enumerate().filter(|(_, &g)| g > 0) {
                self.counters.child(j, Child::Loads, 1);
                self.counters.child(j, Child::LoadTokens, g);
            }
            // The blocks this load writes: from the first one after vLLM's
            // own prefix (never a shared block).
            let bs = self.block_size;
            let local = self
                .table
                .with(req_id, |r| r.state.local_hit_tokens)
                .unwrap_or(0);
            let first = (local / bs) as usize;
            let end = (local + num_external_tokens).div_ceil(bs) as usize;
            match load_blocks(first..end) {
                Ok(groups) => {
                    let span = match <[Vec<u32>; 1]>::try_from(groups) {
                        Ok([group0]) => group0,
                        Err(_) => Vec::new(),
                    };
                    if async_loaders & self.load_deadline_bits() != 0 && !span.is_empty() {
                        self.lock_outbox()
                            .load_blocks
                            .insert(req_id.to_owned(), span.clone());
                    }
                    self.watch(req_id, first, span)
                }
                Err(e) => {
                    self.forget(req_id);
                    return Err(MuxError::Host(e));
                }
            }
        }
        self.saves_allocated(req_id, &given);
        if self.measuring() {
            self.note_allocated(req_id, num_external_tokens, &given, async_loaders);
        }
        // A child never asked about the request (its breaker was open from
        // the start) has nothing to update: it is not told.
        for (i, &given) in given.iter().enumerate() {
            if took_part & (1u64 << i) == 0 {
                continue;
            }
            if let Err(fault) = tell(i, given) {
                self.forget(req_id);
                return Err(MuxError::child(i, hook::ALLOC, fault));
            }
        }
        Ok(chosen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::scheduler::test_support::*;
    use proptest::prelude::*;

    #[test]
    fn allocation_tells_the_chosen_child_only_and_watches_its_load() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |i, _| hit([0, 32, 64][i])).unwrap();
        let mut told = vec![];
        let chosen = m
            .allocated("r", 32, blocks(vec![vec![7, 8]]), |i, n| {
                told.push((i, n));
                Ok(())
            })
            .unwrap();
        assert_eq!(chosen, Some(1));
        assert_eq!(told, [(0, 0), (1, 32), (2, 0)]);
        assert!(m.watching());
        let s = m.snapshot();
        assert_eq!(s.children[1][Child::Loads as usize], 1);
        assert_eq!(s.children[1][Child::LoadTokens as usize], 32);
        // The second call vLLM makes after an async load tells everyone 0.
        told.clear();
        let again = m
            .allocated("r", 0, no_blocks, |i, n| {
                told.push((i, n));
                Ok(())
            })
            .unwrap();
        assert_eq!(again, None);
        assert_eq!(told, [(0, 0), (1, 0), (2, 0)]);
    }

    #[test]
    fn allocation_fault_drops_state_and_watch() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        let err = m
            .allocated("r", 16, blocks(vec![vec![1]]), |i, _| {
                if i == 1 {
                    Err(ChildFault::Raised("no".to_owned()))
                } else {
                    Ok(())
                }
            })
            .unwrap_err();
        assert!(matches!(
            err,
            MuxError::Child {
                child: 1,
                hook: hook::ALLOC,
                ..
            }
        ));
        assert_eq!(m.live_requests(), 0);
        assert!(!m.watching());
    }

    #[test]
    fn a_resumed_request_credits_each_token_once_to_its_first_source() {
        // Child 1 loads 48 tokens; preempted, the request is looked up again
        // and vLLM's cache holds those 48 and 16 it computed: the child
        // keeps its 48, vLLM's cache gets the 16 after them.
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |i, _| hit([0, 48][i])).unwrap();
        m.allocated("r", 48, no_blocks, no_tell).unwrap();
        m.lookup("r", 64, |_, _| hit(0)).unwrap();
        m.lookup("r", 64, |_, _| hit(0)).unwrap(); // a repeat: the same admission
        m.allocated("r", 0, no_blocks, no_tell).unwrap();
        let s = supplied(&m, "r");
        assert_eq!(
            (s.extra, s.by_child.to_vec(), s.local),
            (48, vec![0, 48], 16)
        );
        let snap = m.snapshot();
        assert_eq!(snap.children[1][Child::ServedTokens as usize], 48);
        assert_eq!(snap.totals[Total::LocalCachedTokens as usize], 16);
        // Resumed with a reload past the old span: only the new tokens count.
        m.lookup("s", 0, |i, _| hit([0, 48][i])).unwrap();
        m.allocated("s", 48, no_blocks, no_tell).unwrap();
        m.lookup("s", 32, |i, _| hit([32, 0][i])).unwrap();
        m.allocated("s", 32, no_blocks, no_tell).unwrap();
        let s = supplied(&m, "s");
        assert_eq!(
            (s.extra, s.by_child.to_vec(), s.local),
            (64, vec![16, 48], 0)
        );
        // Preempted, then aborted before it was admitted again: the first
        // admission stands.
        m.lookup("t", 0, |i, _| hit([0, 48][i])).unwrap();
        m.allocated("t", 48, no_blocks, no_tell).unwrap();
        m.lookup("t", 48, |_, _| hit(0)).unwrap();
        let s = supplied(&m, "t");
        assert_eq!(
            (s.extra, s.by_child.to_vec(), s.local),
            (48, vec![0, 48], 0)
        );
        // Its credits lived in its one entry: none are left behind.
        assert_eq!(m.live_requests(), 0, "no credits left behind");
    }

    #[test]
    fn an_async_loads_second_allocation_is_the_same_admission() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        async_load(&m, "r", 48);
        m.allocated("r", 0, no_blocks, no_tell).unwrap();
        let s = supplied(&m, "r");
        assert_eq!((s.extra, s.local), (48, 0));
    }

    proptest! {
        /// Any admissions (local hit, then a span), in any order: the
        /// credits add up to at most the furthest token reached, and never
        /// shrink.
        #[test]
        fn credits_count_each_token_once(adm in proptest::collection::vec((0u64..8, 0u64..8, 0usize..2), 1..6)) {
            let mut c = Credits::default();
            let mut reach = 0;
            for (local, span, child) in adm {
                let (local, span) = (local * 16, span * 16);
                let mut split = [0u64; 2];
                split[child] = span;
                let before = c.clone();
                c.add(local, &split);
                reach = reach.max(local + span);
                prop_assert_eq!(c.covered, reach);
                prop_assert_eq!(c.local + c.by_child.iter().sum::<u64>(), reach);
                prop_assert!(c.local >= before.local);
            }
        }
    }

    #[test]
    fn an_async_load_is_announced_with_its_child() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        let lazy = |i: usize| -> R<ChildMatch> {
            Ok(ChildMatch {
                tokens: Some(if i == 1 { 32 } else { 0 }),
                load_async: i == 1,
            })
        };
        m.lookup("r", 0, |i, _| lazy(i)).unwrap();
        m.allocated("r", 32, no_blocks, no_tell).unwrap();
        assert_eq!(m.take_outbox().loads.get("r"), Some(&0b10));
        // vLLM's second call once the load is done announces nothing.
        m.allocated("r", 0, no_blocks, no_tell).unwrap();
        assert!(m.take_outbox().is_empty());
        // A synchronous load is not waited for.
        m.lookup("s", 0, |i, _| hit([0, 16][i])).unwrap();
        m.allocated("s", 16, no_blocks, no_tell).unwrap();
        assert!(m.take_outbox().is_empty());
    }

    #[test]
    fn each_child_and_the_local_cache_are_credited_their_tokens() {
        let m = mux(3, ClashPolicy::Error, LoadPolicy::Longest);
        m.lookup("r", 16, |i, _| hit([0, 48, 32][i])).unwrap();
        m.allocated("r", 48, no_blocks, no_tell).unwrap();
        let s = supplied(&m, "r");
        assert_eq!((s.extra, s.local), (48, 16));
        assert_eq!(s.by_child[..], [0, 48, 0]);
        assert_eq!(s.by_child.iter().sum::<u64>(), s.extra);
        let snap = m.snapshot();
        assert_eq!(snap.children[1][Child::ServedTokens as usize], 48);
        assert_eq!(snap.children[2][Child::ServedTokens as usize], 0);
        assert_eq!(snap.totals[Total::LocalCachedTokens as usize], 16);
        // Counted whether or not the request asked.
        m.lookup("s", 0, |i, _| hit([0, 0, 32][i])).unwrap();
        m.allocated("s", 32, no_blocks, no_tell).unwrap();
        finish_with(&m, "s", false, (0..3).map(|_| done(false, None)).collect()).unwrap();
        assert_eq!(m.snapshot().children[2][Child::ServedTokens as usize], 32);
    }

    #[test]
    fn compose_cuts_spans_from_the_end_when_vllm_allocates_less_or_a_load_fails() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::Compose);
        m.lookup("r", 0, |i, _| hit([32, 32][i])).unwrap();
        let mut told = vec![];
        m.allocated("r", 48, blocks(vec![vec![1, 2, 3, 4]]), |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(told, [(0, 32), (1, 16)]);
        // Block 2 (tokens 32..48, child 1's span) fails: vLLM recomputes it.
        assert_eq!(m.load_errors(|b| b == 3, |_| false), 1);
        assert_eq!(supplied(&m, "r").by_child[..], [32, 0]);
    }
}
