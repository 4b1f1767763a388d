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
