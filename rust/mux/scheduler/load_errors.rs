//! Load errors (`update_connector_output`'s `invalid_block_ids` and
//! `failed_recving`) and load deadlines: the watched loads
//! ([`SchedulerMux::load_errors`]).

use super::*;
use std::sync::atomic::Ordering::Relaxed;
use std::time::Duration;

use crate::error::MuxError;

impl SchedulerMux {
    /// Give child i a load deadline `deadlines[i]`: an async load of it
    /// still unfinished that long after the workers heard of it is failed
    /// for the request (vLLM recomputes or fails it, by its
    /// `kv_load_failure_policy`), and the child's late completion of it is
    /// dropped as a stray ([`SchedulerMux::expire_loads`]).
    pub fn with_load_deadlines<E>(
        mut self,
        deadlines: Vec<Option<Duration>>,
    ) -> Result<Self, MuxError<E>> {
        self.one_per_child("load deadline", deadlines.len())?;
        self.any_load_deadline = deadlines.iter().any(Option::is_some);
        self.load_deadlines = deadlines;
        Ok(self)
    }

    /// Bit set of the children with a load deadline.
    pub(super) fn load_deadline_bits(&self) -> u64 {
        if !self.any_load_deadline {
            return 0;
        }
        deadline_bits(&self.load_deadlines)
    }

    pub(super) fn watch(&self, req_id: &str, blocks: Vec<u32>) {
        self.table.with_mut(req_id, |r| {
            if r.watched.replace(blocks).is_none() {
                self.n_watched.fetch_add(1, Relaxed);
            }
        });
    }

    pub(super) fn unwatch(&self, req_id: &str) {
        if self.n_watched.load(Relaxed) > 0 {
            self.table.with_mut(req_id, |r| {
                if r.watched.take().is_some() {
                    self.n_watched.fetch_sub(1, Relaxed);
                }
            });
        }
    }

    /// Whether any planned load is watched for errors.
    pub fn watching(&self) -> bool {
        self.n_watched.load(Relaxed) > 0
    }

    /// The workers report failed loads (`invalid_block` of device blocks,
    /// `failed_request` of whole requests): each watched request whose load
    /// they hit stops counting the tokens vLLM recomputes (a failed request
    /// all of them; otherwise every token from its first invalid block on)
    /// and leaves the watch (a retry is a new load). Returns how many
    /// requests lost tokens.
    pub fn load_errors(
        &self,
        invalid_block: impl Fn(u32) -> bool,
        failed_request: impl Fn(&str) -> bool,
    ) -> usize {
        if !self.watching() {
            return 0;
        }
        let bs = self.block_size;
        let mut hit = Vec::new();
        self.table.for_each(|id, r| {
            let Some(blocks) = r.watched.as_deref() else {
                return;
            };
            let st = &r.state;
            if st.loaded_tokens == 0 {
                return;
            }
            let (local, external) = (st.local_hit_tokens, st.loaded_tokens);
            let lost = if failed_request(id) {
                external
            } else {
                let end = local.saturating_add(external);
                let last = blocks.len().min(end.div_ceil(bs) as usize);
                ((local / bs) as usize..last)
                    .find(|&idx| invalid_block(blocks[idx]))
                    .map_or(0, |idx| end - local.max(idx as u64 * bs))
            };
            if lost > 0 {
                hit.push((id.to_owned(), lost));
            }
        });
        for (req_id, lost) in &hit {
            self.table.load_failed(req_id, *lost);
            self.unwatch(req_id);
        }
        hit.len()
    }
}
