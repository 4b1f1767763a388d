//! `update_connector_output`'s completions: [`SchedulerMux::reported`]
//! holds back all but the last completion of a request aborted mid-load
//! beside an async save ([`Held`]).

use super::*;
use std::sync::atomic::Ordering::Relaxed;

/// The completions [`SchedulerMux::reported`] holds back from vLLM this step.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Held {
    pub recving: Vec<String>,
    pub sending: Vec<String>,
}

impl SchedulerMux {
    /// Whether [`SchedulerMux::reported`] needs the step's completions: some live
    /// request waits for its asynchronous load, or some finished one for its
    /// last completion.
    pub fn tracking_loads(&self) -> bool {
        self.table.any_loading() || self.n_joined.load(Relaxed) != 0
    }

    /// Scheduler side, `update_connector_output`: the ids the workers
    /// report finished receiving and finished sending this step, before
    /// vLLM reads them. A live request's load is no longer pending. A
    /// request that finished (was aborted) while vLLM waited for its
    /// asynchronous load, and that a child saves asynchronously, is freed
    /// by vLLM on the first completion it hears of, receive or send, and a
    /// second one crashes vLLM (`assert req_id in self.requests`): every
    /// completion of it but the last is [`Held`] back, to be removed from
    /// what vLLM reads. Its blocks are freed once the load and the save
    /// both ended, never under either.
    pub fn reported<S: AsRef<str>>(&self, recving: &[S], sending: &[S]) -> Held {
        let mut held = Held::default();
        if !self.tracking_loads() {
            return held;
        }
        if self.measuring() {
            self.note_received(recving);
        }
        let arrive = |id: &str, this: u8| -> bool {
            if this == RECV_DUE && self.table.load_reported(id) {
                return false;
            }
            if self.n_joined.load(Relaxed) == 0 {
                return false;
            }
            let Some(mut due) = self.joined.get_mut(id) else {
                return false;
            };
            *due &= !this;
            if *due != 0 {
                return true;
            }
            drop(due);
            if self.joined.remove_if(id, |_, d| *d == 0).is_some() {
                self.n_joined.fetch_sub(1, Relaxed);
            }
            false
        };
        for id in recving {
            if arrive(id.as_ref(), RECV_DUE) {
                held.recving.push(id.as_ref().to_owned());
            }
        }
        for id in sending {
            if arrive(id.as_ref(), SEND_DUE) {
                held.sending.push(id.as_ref().to_owned());
            }
        }
        held
    }

    /// Finished requests whose last completion vLLM still waits for
    /// ([`SchedulerMux::reported`]).
    pub fn joined_requests(&self) -> usize {
        self.n_joined.load(Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::scheduler::test_support::*;

    fn none() -> [&'static str; 0] {
        []
    }

    #[test]
    fn an_abort_mid_load_beside_a_saver_passes_only_the_last_completion() {
        // Load first, save after; save first, load after; both in one step.
        for order in 0..3 {
            let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
            async_load(&m, "r", 48);
            assert!(m.tracking_loads());
            let f = finish_with(&m, "r", false, vec![done(false, None), done(true, None)]);
            assert!(f.unwrap().async_save);
            assert_eq!(m.joined_requests(), 1);
            let held = match order {
                0 => {
                    let first = m.reported(&["r"], &none());
                    assert_eq!(first.recving, ["r"], "the load, with the save still due");
                    m.reported(&none(), &["r"])
                }
                1 => {
                    let first = m.reported(&none(), &["r"]);
                    assert_eq!(first.sending, ["r"], "the save, with the load still due");
                    m.reported(&["r"], &none())
                }
                _ => {
                    let both = m.reported(&["r"], &["r"]);
                    assert_eq!((both.recving, both.sending), (vec!["r".to_owned()], vec![]));
                    Held::default()
                }
            };
            assert_eq!(held, Held::default(), "the last one passes");
            assert_eq!(m.joined_requests(), 0);
            assert!(!m.tracking_loads());
            assert_eq!(
                m.reported(&["r"], &["r"]),
                Held::default(),
                "later ones pass"
            );
        }
    }

    #[test]
    fn a_load_reported_before_the_finish_or_no_saver_holds_nothing() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        async_load(&m, "r", 48);
        // vLLM heard the load finished before the abort: it waits for the save only.
        assert_eq!(m.reported(&["r"], &none()), Held::default());
        assert!(!m.tracking_loads());
        finish_with(&m, "r", false, vec![done(false, None), done(true, None)]).unwrap();
        assert_eq!(m.joined_requests(), 0);
        assert_eq!(m.reported(&none(), &["r"]), Held::default());
        // Nobody saves: vLLM frees the aborted request on its load's report.
        async_load(&m, "s", 32);
        finish_with(&m, "s", false, vec![done(false, None), done(false, None)]).unwrap();
        assert_eq!(m.joined_requests(), 0);
        assert!(!m.tracking_loads());
        assert_eq!(m.reported(&["s"], &none()), Held::default());
        // A synchronous load is never pending.
        m.lookup("t", 0, |_, _| hit(32)).unwrap();
        m.allocated("t", 32, no_blocks, no_tell).unwrap();
        assert!(!m.tracking_loads());
    }

    #[test]
    fn a_forgotten_request_is_no_longer_loading() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
        async_load(&m, "r", 48);
        assert!(m.forget("r"));
        assert!(!m.tracking_loads());
    }
}
