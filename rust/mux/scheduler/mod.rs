//! The scheduler side of the multiplexer: [`SchedulerMux`].

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::Duration;

use dashmap::{DashMap, DashSet};

use super::hma::Hma;
use super::*;
use crate::error::MuxError;
use crate::mux::breaker::{BreakerConfig, Breakers, State, Transition};
use crate::mux::merge::ClashPolicy;
use crate::mux::requests::{Entry, LoadPolicy, RequestState, RequestTable};

mod admission;
mod decision;
mod finish;
mod held;
mod load_errors;
mod lookup;
mod saves;
#[cfg(test)]
mod test_support;

use crate::mux::stats::{Child, Counters, Snapshot, Total};
pub use admission::Credits;
pub use decision::{wall_clock, About, ChildTimeline, Timeline};
pub use finish::{ChildAnswer, FinishHooks, FinishResult, ParamsError, PartialTail};
pub use held::Held;

/// [`SchedulerMux::reported`]: the finished-receiving completion is still due.
const RECV_DUE: u8 = 1;
/// [`SchedulerMux::reported`]: the finished-sending completion is still due.
const SEND_DUE: u8 = 2;

/// The scheduler side of the multiplexer of `n` children: every rule a
/// request's scheduler-side events follow (lookup, allocation, finish,
/// partial tail, load errors, the outbox to the workers).
#[derive(Debug)]
pub struct SchedulerMux {
    names: Vec<String>,
    clash: ClashPolicy,
    pub(super) load: LoadPolicy,
    block_size: u64,
    /// Every live request: one entry, all its state ([`Request`]).
    pub(super) table: RequestTable<Request>,
    counters: Counters,
    warned_keys: DashSet<String>,
    /// Bit i: child i's contained failure was logged loudly once.
    warned_contained: AtomicU64,
    outbox: Mutex<Outbox>,
    /// Live requests with a watched load ([`Request::watched`]).
    n_watched: AtomicUsize,
    /// Per child: how long a lookup may stay "not ready" (None: forever).
    deadlines: Vec<Option<Duration>>,
    any_deadline: bool,
    breakers: Breakers,
    /// Bit i: child i's contained lookup error was logged loudly once.
    warned_lookup: AtomicU64,
    /// Per child: how long an async load may stay unfinished (None:
    /// forever).
    load_deadlines: Vec<Option<Duration>>,
    any_load_deadline: bool,
    /// Requests finished (no longer live: not in `table`) while vLLM waited for their asynchronous load and
    /// saved asynchronously -> the completions still due ([`RECV_DUE`],
    /// [`SEND_DUE`]): vLLM frees such a request on the first of them, so
    /// only the last is passed on ([`SchedulerMux::reported`]).
    joined: DashMap<String, u8>,
    n_joined: AtomicUsize,
    /// Which children take every KV cache group.
    hma: Hma,
    /// `load_decision: "cost"` and the timeline (None: both off).
    measure: Option<Box<decision::Measure>>,
    /// Save admission (None: every child takes every save).
    saves: Option<Box<saves::Saves>>,
}

/// Everything the scheduler side keeps for one live request, in one entry
/// of one map ([`SchedulerMux::table`]): forgetting a request is removing
/// it. The parts most requests never have are boxed.
#[derive(Debug, Default)]
pub(crate) struct Request {
    /// Its lookups, choice, allocation and load ([`RequestState`]).
    pub(super) state: RequestState,
    /// Its planned load, watched for load errors
    /// ([`SchedulerMux::load_errors`]; counted in `n_watched`): the index
    /// of the load's first block, and the load's device blocks (group 0;
    /// none with several groups).
    pub(super) watched: Option<(usize, Vec<u32>)>,
    /// `compose`: each child's span at the latest ready lookup (tokens,
    /// loads asynchronously).
    pub(super) spans: Option<Box<[(u64, bool)]>>,
    /// Admitted more than once (preempted, or a failed async load
    /// retried): the tokens its earlier admissions credited.
    pub(super) credits: Option<Box<Credits>>,
    /// Where its time went (the decision or the timeline is on).
    pub(super) timeline: Option<Box<Timeline>>,
    /// Its save admission ([`saves`]; admission is on).
    pub(super) saves: Option<Box<saves::RequestSaves>>,
}

impl Entry for Request {
    #[inline]
    fn state(&self) -> &RequestState {
        &self.state
    }
    #[inline]
    fn state_mut(&mut self) -> &mut RequestState {
        &mut self.state
    }
}

impl SchedulerMux {
    /// A multiplexer over children named `names` (1 to [`MAX_CHILDREN`]).
    pub fn new<E>(
        names: Vec<String>,
        clash: ClashPolicy,
        load: LoadPolicy,
        block_size: u64,
    ) -> Result<Self, MuxError<E>> {
        check_names(&names)?;
        let n = names.len();
        if block_size == 0 {
            return Err(MuxError::Config("block_size must be at least 1".into()));
        }
        Ok(Self {
            counters: Counters::new(names.len()),
            breakers: Breakers::new(vec![None; names.len()]),
            names,
            clash,
            load,
            block_size,
            table: RequestTable::default(),
            warned_keys: DashSet::new(),
            warned_contained: AtomicU64::new(0),
            outbox: Mutex::new(Outbox::default()),
            n_watched: AtomicUsize::new(0),
            deadlines: Vec::new(),
            any_deadline: false,
            warned_lookup: AtomicU64::new(0),
            load_deadlines: Vec::new(),
            any_load_deadline: false,
            joined: DashMap::new(),
            n_joined: AtomicUsize::new(0),
            hma: Hma::new(vec![true; n]),
            measure: None,
            saves: None,
        })
    }

    /// A per-child setting must have one entry per child.
    fn one_per_child<E>(&self, what: &str, got: usize) -> Result<(), MuxError<E>> {
        one_per_child(what, self.names.len(), got)
    }

    /// Give child i a lookup deadline `deadlines[i]`: a child still answering
    /// "not ready" that long after the request's first lookup is treated as
    /// a miss for it, is not asked again, and its later answers never count
    /// (it still gets the allocation, with 0 tokens, and the finish, so it
    /// releases what it reserved through its normal path).
    pub fn with_lookup_deadlines<E>(
        mut self,
        deadlines: Vec<Option<Duration>>,
    ) -> Result<Self, MuxError<E>> {
        self.one_per_child("lookup deadline", deadlines.len())?;
        self.any_deadline = deadlines.iter().any(Option::is_some);
        self.deadlines = deadlines;
        Ok(self)
    }

    /// Give child i the circuit breaker `breakers[i]` (see
    /// [`crate::mux::breaker`]): its failed lookups (deadline missed, or raised:
    /// then contained as a miss instead of failing the call) open it, and
    /// while it is open the child is a miss, not asked, for every request
    /// but the probe. It still gets every other hook.
    pub fn with_breakers<E>(
        mut self,
        breakers: Vec<Option<BreakerConfig>>,
    ) -> Result<Self, MuxError<E>> {
        self.one_per_child("breaker setting", breakers.len())?;
        for b in breakers.iter().flatten() {
            crate::mux::settings::check_breaker(b).map_err(|e| MuxError::Config(e.to_string()))?;
        }
        self.breakers = Breakers::new(breakers);
        Ok(self)
    }

    /// Child i's breaker state (None: it has no breaker).
    pub fn breaker(&self, i: usize) -> Option<State> {
        self.breakers.state(i)
    }

    /// Breaker transitions since the previous take, oldest first (to log).
    pub fn take_breaker_transitions(&self) -> Vec<Transition> {
        self.breakers.take_transitions()
    }

    /// Every child's breaker state when one changed since the previous call.
    pub fn take_breaker_changes(&self) -> Option<Vec<Option<State>>> {
        self.breakers.take_changed()
    }

    /// Tell it which children support the hybrid KV cache manager
    /// (`hma[i]`; a request it must refuse: [`SchedulerMux::finish_route`]).
    pub fn with_hma<E>(mut self, hma: Vec<bool>) -> Result<Self, MuxError<E>> {
        self.one_per_child("HMA flag", hma.len())?;
        self.hma = Hma::new(hma);
        Ok(self)
    }

    /// How many children it multiplexes.
    pub fn n_children(&self) -> usize {
        self.names.len()
    }

    /// Child `i`'s name; the multiplexer's own name for `i == n_children()`.
    pub fn name(&self, i: usize) -> &str {
        self.names.get(i).map_or("kvmux", String::as_str)
    }

    pub fn clash_policy(&self) -> ClashPolicy {
        self.clash
    }

    /// Requests the multiplexer holds state for.
    pub fn live_requests(&self) -> usize {
        self.table.len()
    }

    /// Drop a request's state without counting it finished. True if there was.
    pub fn forget(&self, req_id: &str) -> bool {
        self.release_probe(req_id);
        self.remove(req_id).is_some()
    }

    /// A request's entry leaves the table, all its state with it.
    pub(super) fn remove(&self, req_id: &str) -> Option<Request> {
        let r = self.table.finish(req_id)?;
        if r.watched.is_some() {
            self.n_watched.fetch_sub(1, Relaxed);
        }
        Some(r)
    }

    /// What the workers must be told with the next step's metadata (taken:
    /// the next call returns only what happened since).
    pub fn take_outbox(&self) -> Outbox {
        let mut out = self.lock_outbox();
        if out.is_empty() {
            return Outbox::default();
        }
        std::mem::take(&mut *out)
    }

    fn lock_outbox(&self) -> std::sync::MutexGuard<'_, Outbox> {
        self.outbox.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn snapshot(&self) -> Snapshot {
        self.counters.snapshot()
    }

    /// The counters' interval, once `every` has passed since the previous
    /// take, and always when no request is live (so a workload's last
    /// counts reach vLLM when it ends); None otherwise, the counts kept for
    /// the next take.
    pub fn take_interval_every(&self, every: std::time::Duration) -> Option<Snapshot> {
        self.counters
            .take_interval_every(every, self.table.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    #[test]
    fn new_refuses_zero_or_too_many_children() {
        for n in [0, MAX_CHILDREN + 1] {
            let names = (0..n).map(|i| i.to_string()).collect();
            let err = SchedulerMux::new::<String>(names, ClashPolicy::Error, LoadPolicy::First, 16);
            assert!(matches!(err, Err(MuxError::Config(_))));
        }
    }

    #[test]
    fn bad_breaker_settings_are_refused() {
        let d = Duration::from_millis;
        for (failures, cooldown, max) in [(0, d(1), d(1)), (1, d(0), d(1)), (1, d(2), d(1))] {
            let cfg = BreakerConfig {
                failures,
                cooldown,
                max_cooldown: max,
            };
            let got = mux(1, ClashPolicy::Error, LoadPolicy::First)
                .with_breakers::<String>(vec![Some(cfg)]);
            assert!(matches!(got, Err(MuxError::Config(_))));
        }
    }

    #[test]
    fn deadlines_are_one_per_child() {
        let err = mux(2, ClashPolicy::Error, LoadPolicy::First)
            .with_lookup_deadlines::<String>(vec![None]);
        assert!(matches!(err, Err(MuxError::Config(_))));
    }

    #[test]
    fn interval_stats_wait_while_requests_live_and_flush_when_idle() {
        let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
        let hour = std::time::Duration::from_secs(3600);
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        assert!(
            m.take_interval_every(hour).is_some(),
            "the first take is due"
        );
        m.lookup("r", 0, |_, _| hit(16)).unwrap();
        assert!(m.take_interval_every(hour).is_none(), "r is live: not due");
        finish_with(&m, "r", false, vec![done(false, None)]).unwrap();
        let flushed = m.take_interval_every(hour).expect("idle: flushed");
        assert_eq!(flushed.children[0][Child::Lookups as usize], 1);
        assert_eq!(flushed.totals[Total::Finished as usize], 1);
    }
}
