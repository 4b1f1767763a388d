//! The worker side of the multiplexer: [`WorkerMux`], the completions the
//! workers wait for (with each child's identity) and the worker's counters.
//! It holds nothing of a request's scheduler-side state.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use dashmap::DashMap;

use super::{check_names, deadline_bits, one_per_child};
use crate::error::MuxError;
use crate::mux::completions::{Completions, Verdict};
use crate::mux::stats::{Child, Counters, Snapshot, Total};

/// The worker side of the multiplexer of `n` children.
#[derive(Debug)]
pub struct WorkerMux {
    names: Vec<String>,
    counters: Counters,
    /// Per child: how long an async load may stay unfinished (None:
    /// forever).
    load_deadlines: Vec<Option<Duration>>,
    any_load_deadline: bool,
    /// The completions it waits for.
    completions: Completions,
    /// Request id -> device blocks of its load, for loads by a child with a
    /// deadline (vLLM without failed receives).
    load_blocks: DashMap<String, Vec<u32>>,
    /// Blocks of loads that missed their deadline, to report as load errors.
    timed_out_blocks: Mutex<Vec<u32>>,
}

impl WorkerMux {
    /// The worker side over children named `names` (1 to
    /// [`crate::mux::requests::MAX_CHILDREN`]), child i's async loads failed
    /// once `load_deadlines[i]` passed (see [`WorkerMux::expire_loads`]).
    pub fn new<E>(
        names: Vec<String>,
        load_deadlines: Vec<Option<Duration>>,
    ) -> Result<Self, MuxError<E>> {
        check_names(&names)?;
        one_per_child("load deadline", names.len(), load_deadlines.len())?;
        Ok(Self {
            counters: Counters::new(names.len()),
            any_load_deadline: load_deadlines.iter().any(Option::is_some),
            load_deadlines,
            names,
            completions: Completions::new(),
            load_blocks: DashMap::new(),
            timed_out_blocks: Mutex::new(Vec::new()),
        })
    }

    /// How many children it multiplexes.
    pub fn n_children(&self) -> usize {
        self.names.len()
    }

    /// Child `i`'s name; the multiplexer's own name for `i == n_children()`.
    pub fn name(&self, i: usize) -> &str {
        self.names.get(i).map_or("kvmux", String::as_str)
    }

    /// what the scheduler side announced (an [`Outbox`]).
    pub fn expect(&self, saves: &[(&str, u64, u32)], loads: &[(&str, u64)]) {
        for &(req_id, children, need) in saves {
            self.completions.expect_send(req_id, children, need);
        }
        let timed = if self.any_load_deadline {
            deadline_bits(&self.load_deadlines)
        } else {
            0
        };
        let now = (timed != 0 && loads.iter().any(|&(_, c)| c & timed != 0)).then(Instant::now);
        for &(req_id, children) in loads {
            let since = now.filter(|_| children & timed != 0);
            self.completions.expect_recv_since(req_id, children, since);
        }
    }

    /// the device blocks of loads by a child with a deadline
    /// (the scheduler side's [`Outbox::load_blocks`]), kept to report as
    /// load errors if the load misses its deadline; needed only where vLLM
    /// has no failed receives.
    pub fn expect_load_blocks(&self, blocks: impl IntoIterator<Item = (String, Vec<u32>)>) {
        for (req_id, b) in blocks {
            self.load_blocks.insert(req_id, b);
        }
    }

    /// Once per step: every async load a child with a deadline
    /// has left unfinished past it is failed for the request (counted in
    /// `load_timeouts` of that child; its late completion will be a stray).
    /// `done(req_id)` gets each request to report finished and failed
    /// receiving now (no other loader owes it); the blocks of the loads
    /// that timed out go to [`WorkerMux::take_timed_out_blocks`].
    pub fn expire_loads(&self, now: Instant, mut done: impl FnMut(&str)) {
        if !self.any_load_deadline || self.completions.pending_recvs() == 0 {
            return;
        }
        self.completions
            .expire_recvs(&self.load_deadlines, now, |req_id, late, finished| {
                let mut bits = late;
                while bits != 0 {
                    let i = bits.trailing_zeros() as usize;
                    bits &= bits - 1;
                    self.counters.child(i, Child::LoadTimeouts, 1);
                }
                if let Some((_, b)) = self.load_blocks.remove(req_id) {
                    self.lock_timed_out().extend(b);
                }
                if finished {
                    done(req_id);
                }
            });
    }

    /// blocks of loads that missed their deadline since the
    /// last take (vLLM's `get_block_ids_with_load_errors`).
    pub fn take_timed_out_blocks(&self) -> Vec<u32> {
        if !self.any_load_deadline {
            return Vec::new();
        }
        std::mem::take(&mut *self.lock_timed_out())
    }

    fn lock_timed_out(&self) -> std::sync::MutexGuard<'_, Vec<u32>> {
        self.timed_out_blocks
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// child i reported `req_id` finished sending. True when
    /// the request is finished sending now (every saver reported); a
    /// completion the child did not owe is dropped and counted.
    pub fn sent(&self, i: usize, req_id: &str) -> bool {
        match self.completions.sent(i, req_id) {
            // A send is never failed.
            Verdict::Done | Verdict::Failed => {
                self.counters.child(i, Child::SaveCompletions, 1);
                self.counters.total(Total::FinishedSending, 1);
                true
            }
            Verdict::Waiting => {
                self.counters.child(i, Child::SaveCompletions, 1);
                false
            }
            Verdict::Stray => {
                self.counters.child(i, Child::StrayCompletions, 1);
                false
            }
        }
    }

    /// child i reported `req_id` finished receiving, its load
    /// `failed` or not. Once every child that loads the request
    /// asynchronously has reported it: `Some(failed)`, failed when any of
    /// them failed (vLLM must hear "finished" and "failed" then, never one
    /// without the other). A completion the child did not owe is dropped
    /// and counted.
    pub fn received(&self, i: usize, req_id: &str, failed: bool) -> Option<bool> {
        let verdict = self.completions.received(i, req_id, failed);
        let counter = match verdict {
            Verdict::Stray => Child::StrayCompletions,
            _ => Child::LoadCompletions,
        };
        self.counters.child(i, counter, 1);
        let out = match verdict {
            Verdict::Done => Some(false),
            Verdict::Failed => Some(true),
            Verdict::Waiting | Verdict::Stray => None,
        };
        if out.is_some() && self.any_load_deadline {
            self.load_blocks.remove(req_id);
        }
        out
    }

    /// child i's receive results of one step, `finished` and
    /// `failed` ids (vLLM's contract puts a failed id in both; one in
    /// `failed` only counts the same): each id is one completion of the
    /// child. `done(req_id, failed)` gets each request finished receiving
    /// now.
    pub fn received_results<S: AsRef<str>>(
        &self,
        i: usize,
        finished: &[S],
        failed: &[S],
        mut done: impl FnMut(&S, bool),
    ) {
        for id in failed {
            if let Some(f) = self.received(i, id.as_ref(), true) {
                done(id, f);
            }
        }
        for id in finished {
            if failed.iter().any(|f| f.as_ref() == id.as_ref()) {
                continue;
            }
            if let Some(f) = self.received(i, id.as_ref(), false) {
                done(id, f);
            }
        }
    }

    /// requests still waiting for send completions.
    pub fn pending_sends(&self) -> usize {
        self.completions.pending_sends()
    }

    /// requests still waiting for their load's completion.
    pub fn pending_recvs(&self) -> usize {
        self.completions.pending_recvs()
    }

    /// blocks children failed to load.
    pub fn count_load_failures(&self, blocks: u64) {
        self.counters.total(Total::LoadFailedBlocks, blocks);
    }

    pub fn snapshot(&self) -> Snapshot {
        self.counters.snapshot()
    }

    /// The counters changed since the previous take (a worker holds no
    /// request state, so every take is one).
    pub fn take_interval(&self) -> Option<Snapshot> {
        self.counters.take_interval_every(Duration::ZERO, true)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn worker(n: usize) -> WorkerMux {
        let names = (0..n).map(|i| format!("c{i}")).collect();
        WorkerMux::new::<String>(names, vec![None; n]).unwrap()
    }

    #[test]
    fn workers_report_a_request_once_every_saver_did_and_count_strays() {
        let w = worker(3);
        w.expect(&[("r", 0b011, 2)], &[("l", 0b100)]);
        assert!(!w.sent(0, "r"));
        assert!(!w.sent(0, "r"), "a duplicate counts once");
        assert!(!w.sent(2, "r"), "child 2 never saved it");
        assert!(w.sent(1, "r"));
        assert_eq!(
            w.received(0, "l", false),
            None,
            "only the loading child's receive counts"
        );
        assert_eq!(w.received(2, "l", false), Some(false));
        let snap = w.snapshot();
        let c = |i: usize, k: Child| snap.children[i][k as usize];
        assert_eq!(c(0, Child::SaveCompletions), 1);
        assert_eq!(c(0, Child::StrayCompletions), 2);
        assert_eq!(c(2, Child::StrayCompletions), 1);
        assert_eq!(c(2, Child::LoadCompletions), 1);
        assert_eq!(snap.totals[Total::FinishedSending as usize], 1);
        assert_eq!((w.pending_sends(), w.pending_recvs()), (0, 0));
    }

    #[test]
    fn a_failed_receive_is_reported_finished_and_failed_after_the_last_loader() {
        let w = worker(3);
        w.expect(&[], &[("r", 0b011), ("s", 0b100)]);
        let mut got = Vec::new();
        // Child 0 reports r failed, in both lists (vLLM's contract): one
        // completion, and the request still waits for child 1.
        w.received_results(0, &["r"], &["r"], |id, f| got.push((*id, f)));
        assert!(got.is_empty());
        w.received_results(1, &["r"], &[], |id, f| got.push((*id, f)));
        // Child 2 reports s failed in `failed` only: the same.
        w.received_results(2, &[], &["s"], |id, f| got.push((*id, f)));
        assert_eq!(got, [("r", true), ("s", true)]);
        let snap = w.snapshot();
        let c = |i: usize, k: Child| snap.children[i][k as usize];
        assert_eq!(
            [0, 1, 2].map(|i| c(i, Child::LoadCompletions)),
            [1, 1, 1],
            "a failed id in both lists is one completion"
        );
        assert_eq!(c(0, Child::StrayCompletions), 0);
        assert_eq!(w.pending_recvs(), 0);
    }
}
