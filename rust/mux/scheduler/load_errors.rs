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

    pub(super) fn watch(&self, req_id: &str, first: usize, blocks: Vec<u32>) {
        self.table.with_mut(req_id, |r| {
            if r.watched.replace((first, blocks)).is_none() {
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
            let Some((first, blocks)) = r.watched.as_ref() else {
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
                let block = |idx: usize| idx.checked_sub(*first).and_then(|j| blocks.get(j));
                ((local / bs) as usize..end.div_ceil(bs) as usize)
                    .find(|&idx| block(idx).is_some_and(|&b| invalid_block(b)))
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::scheduler::test_support::*;
    use std::time::Instant;

    #[test]
    fn a_load_is_watched_for_block_errors_only_on_a_single_group_model() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        m.allocated("r", 16, blocks(vec![vec![1], vec![2]]), no_tell)
            .unwrap();
        assert_eq!(
            m.load_errors(|b| b == 1, |_| false),
            0,
            "several groups: no block-level errors, vLLM fails whole requests"
        );
        assert_eq!(m.load_errors(|_| false, |r| r == "r"), 1);
        m.lookup("s", 0, |_, _| hit(16)).unwrap();
        m.allocated("s", 16, blocks(vec![vec![3]]), no_tell)
            .unwrap();
        assert_eq!(m.load_errors(|b| b == 3, |_| false), 1);
    }

    #[test]
    fn a_load_past_its_deadline_is_failed_with_its_blocks_and_its_late_completion_dropped() {
        let timeout = Duration::from_millis(50);
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_load_deadlines::<String>(vec![None, Some(timeout)])
            .unwrap();
        let lazy = |i: usize| -> R<ChildMatch> {
            Ok(ChildMatch {
                tokens: Some(if i == 1 { 40 } else { 0 }),
                load_async: i == 1,
            })
        };
        // 16 tokens in vLLM's own prefix cache (block 7), 40 to load
        // (blocks 8, 9, 10 of 16-token blocks).
        m.lookup("r", 16, |i, _| lazy(i)).unwrap();
        m.allocated("r", 40, blocks(vec![vec![7, 8, 9, 10, 11]]), no_tell)
            .unwrap();
        let out = m.take_outbox();
        assert_eq!(out.loads.get("r"), Some(&0b10));
        assert_eq!(
            out.load_blocks.get("r"),
            Some(&vec![8, 9, 10]),
            "never the shared block"
        );

        // The worker: the clock starts when it hears of the load.
        let w = WorkerMux::new::<String>(vec!["c0".into(), "c1".into()], vec![None, Some(timeout)])
            .unwrap();
        let t0 = Instant::now();
        w.expect(&[], &[("r", 0b10)]);
        w.expect_load_blocks(out.load_blocks);
        let mut failed = Vec::new();
        w.expire_loads(t0, |r| failed.push(r.to_owned()));
        assert!(failed.is_empty() && w.take_timed_out_blocks().is_empty());
        w.expire_loads(t0 + 2 * timeout, |r| failed.push(r.to_owned()));
        assert_eq!(failed, ["r"]);
        assert_eq!(w.take_timed_out_blocks(), [8, 9, 10]);
        assert!(w.take_timed_out_blocks().is_empty(), "taken once");
        assert_eq!(w.pending_recvs(), 0);
        assert_eq!(
            w.received(1, "r", false),
            None,
            "the late completion is dropped"
        );
        let snap = w.snapshot();
        assert_eq!(snap.children[1][Child::LoadTimeouts as usize], 1);
        assert_eq!(snap.children[1][Child::StrayCompletions as usize], 1);
        assert_eq!(snap.children[1][Child::LoadCompletions as usize], 0);
    }

    #[test]
    fn a_load_in_time_keeps_no_blocks_and_a_child_without_a_deadline_waits() {
        let w = WorkerMux::new::<String>(
            vec!["c0".into(), "c1".into()],
            vec![None, Some(Duration::ZERO)],
        )
        .unwrap();
        w.expect(&[], &[("a", 0b01), ("b", 0b10)]);
        w.expect_load_blocks([("b".to_owned(), vec![3])]);
        assert_eq!(w.received(1, "b", false), Some(false));
        let mut failed = Vec::new();
        w.expire_loads(Instant::now() + Duration::from_secs(60), |r| {
            failed.push(r.to_owned())
        });
        assert!(
            failed.is_empty(),
            "a is loaded by a child without a deadline"
        );
        assert!(w.take_timed_out_blocks().is_empty());
        assert_eq!(w.pending_recvs(), 1);
        // Without any load deadline nothing is announced beyond the loads.
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |i, _| -> R<ChildMatch> {
            Ok(ChildMatch {
                tokens: Some(16 * i as u64),
                load_async: i == 1,
            })
        })
        .unwrap();
        m.allocated("r", 16, blocks(vec![vec![1]]), no_tell)
            .unwrap();
        assert!(m.take_outbox().load_blocks.is_empty());
    }

    #[test]
    fn load_errors_take_back_tokens_from_the_first_bad_block() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        // 16 local tokens (block 0), 48 loaded into blocks 1..=3.
        m.lookup("r", 16, |_, _| hit(48)).unwrap();
        m.allocated("r", 48, blocks(vec![vec![10, 11, 12, 13]]), no_tell)
            .unwrap();
        assert_eq!(m.load_errors(|b| b == 10, |_| false), 0, "local block");
        assert_eq!(m.load_errors(|b| b == 12, |_| false), 1);
        assert!(!m.watching(), "reported once");
        let f = finish_with(&m, "r", true, vec![done(false, None)]).unwrap();
        assert_eq!(
            f.params,
            Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 16)])))
        );
    }

    #[test]
    fn failed_request_loses_every_loaded_token() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(32)).unwrap();
        m.allocated("r", 32, no_blocks, no_tell).unwrap();
        assert_eq!(m.load_errors(|_| false, |r| r == "r"), 1);
        let f = finish_with(&m, "r", true, vec![done(false, None)]).unwrap();
        assert_eq!(
            f.params,
            Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 0)])))
        );
    }

    #[test]
    fn finish_and_forget_end_the_watch() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        m.lookup("r", 0, |_, _| hit(32)).unwrap();
        m.allocated("r", 32, blocks(vec![vec![1, 2]]), no_tell)
            .unwrap();
        finish_with(&m, "r", false, vec![done(false, None)]).unwrap();
        assert!(!m.watching());
        m.lookup("s", 0, |_, _| hit(32)).unwrap();
        m.allocated("s", 32, blocks(vec![vec![1, 2]]), no_tell)
            .unwrap();
        m.forget("s");
        assert!(!m.watching());
    }
}
