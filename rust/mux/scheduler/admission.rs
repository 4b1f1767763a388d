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
    /// device blocks (`load_blocks()`: the request's blocks per KV cache
    /// group) are watched for load errors when the model has one group:
    /// vLLM reports block-level load errors for single-group layouts only
    /// (several groups fail whole requests, `failed_recving`, which needs
    /// no blocks). A child failing drops the request's state.
    pub fn allocated<E>(
        &self,
        req_id: &str,
        num_external_tokens: u64,
        load_blocks: impl FnOnce() -> Result<Vec<Vec<u32>>, E>,
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
            match load_blocks() {
                Ok(groups) => {
                    let blocks = match <[Vec<u32>; 1]>::try_from(groups) {
                        Ok([group0]) => group0,
                        Err(_) => Vec::new(),
                    };
                    if async_loaders & self.load_deadline_bits() != 0 && !blocks.is_empty() {
                        // The blocks this load writes: from the first one
                        // after vLLM's own prefix (never a shared block).
                        let bs = self.block_size;
                        let local = self.table.get(req_id).map_or(0, |s| s.local_hit_tokens);
                        let end = (local + num_external_tokens).div_ceil(bs) as usize;
                        let span = blocks
                            .get((local / bs) as usize..end.min(blocks.len()))
                            .unwrap_or_default()
                            .to_vec();
                        self.lock_outbox()
                            .load_blocks
                            .insert(req_id.to_owned(), span);
                    }
                    self.watch(req_id, blocks)
                }
                Err(e) => {
                    self.forget(req_id);
                    return Err(MuxError::Host(e));
                }
            }
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
