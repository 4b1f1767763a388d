//! A circuit breaker per child: a child whose lookups keep failing (missing
//! their deadline, or raising) is not asked for a while.
//!
//! States, per child:
//! - **closed**: asked on every lookup. `failures` consecutive failed
//!   lookups open it; a lookup answered with a count resets the run.
//! - **open**: not asked (a miss) until its cooldown has passed. The first
//!   cooldown is `cooldown`; each failed probe doubles it, up to
//!   `max_cooldown`; closing resets it.
//! - **half open**: the cooldown passed; exactly one request (the *probe*)
//!   asks the child, the others still skip it. The probe's answer with a
//!   count closes the breaker, its failure opens it again. A probe that
//!   ends before either (finished, aborted) hands the probe to the next
//!   request.
//!
//! The closed path costs one relaxed load per child and lookup: the clock is
//! read and the lock taken only while some breaker is not closed, or on a
//! failure. Every state change is queued as a [`Transition`] for the caller
//! to log once.

use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering::Relaxed};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// When a child's breaker opens and how long it stays open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BreakerConfig {
    /// Consecutive failed lookups that open the breaker (at least 1).
    pub failures: u32,
    /// The first cooldown; doubled by each failed probe.
    pub cooldown: Duration,
    /// The longest cooldown.
    pub max_cooldown: Duration,
}

/// A breaker's state.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum State {
    Closed,
    Open,
    HalfOpen,
}

impl State {
    pub fn as_str(self) -> &'static str {
        match self {
            State::Closed => "closed",
            State::Open => "open",
            State::HalfOpen => "half_open",
        }
    }

    /// The value of the Prometheus gauge: 0 closed, 1 half open, 2 open.
    pub fn gauge(self) -> u8 {
        match self {
            State::Closed => 0,
            State::HalfOpen => 1,
            State::Open => 2,
        }
    }
}

/// A child's breaker changed state.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Transition {
    pub child: usize,
    pub from: State,
    pub to: State,
    /// Opened: for how long. Half open: the probe request.
    pub cooldown: Option<Duration>,
    pub probe: Option<String>,
    /// Consecutive failures that led here (opening only).
    pub failures: u32,
}

/// How one lookup of a child went, for its breaker.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Answered with a token count.
    Answered,
    /// Missed its deadline or raised.
    Failed,
}

#[derive(Debug)]
struct Inner {
    state: State,
    /// Open: when the cooldown ends.
    until: Instant,
    /// The cooldown of the next opening.
    cooldown: Duration,
    /// Half open: the request that probes the child (None: the next one).
    probe: Option<String>,
}

#[derive(Debug)]
struct Breaker {
    cfg: BreakerConfig,
    /// Consecutive failed lookups while closed.
    failures: AtomicU32,
    inner: Mutex<Inner>,
}

/// The breakers of a multiplexer's children (None: that child has none).
#[derive(Debug)]
pub struct Breakers {
    each: Vec<Option<Breaker>>,
    /// Bit i: child i's breaker is not closed.
    tripped: AtomicU64,
    /// Bit i: child i may have a run of failures going (set after its count
    /// rises, cleared before it is reset), so that an answer with neither
    /// bit set has nothing to record.
    failing: AtomicU64,
    transitions: Mutex<Vec<Transition>>,
    /// `transitions` is not empty.
    to_log: AtomicBool,
    /// A transition happened since the last `take_changed`.
    changed: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Breakers {
    /// One optional breaker per child.
    pub fn new(cfgs: Vec<Option<BreakerConfig>>) -> Self {
        let now = Instant::now();
        let each = cfgs
            .into_iter()
            .map(|cfg| {
                cfg.map(|cfg| Breaker {
                    cfg,
                    failures: AtomicU32::new(0),
                    inner: Mutex::new(Inner {
                        state: State::Closed,
                        until: now,
                        cooldown: cfg.cooldown,
                        probe: None,
                    }),
                })
            })
            .collect();
        Self {
            each,
            tripped: AtomicU64::new(0),
            failing: AtomicU64::new(0),
            transitions: Mutex::new(Vec::new()),
            to_log: AtomicBool::new(false),
            changed: AtomicBool::new(false),
        }
    }

    /// Child i has a breaker.
    pub fn has(&self, i: usize) -> bool {
        matches!(self.each.get(i), Some(Some(_)))
    }

    /// Some breaker is not closed.
    pub fn any_tripped(&self) -> bool {
        self.tripped.load(Relaxed) != 0
    }

    /// No breaker is open or counting a run of failures: every child is
    /// admitted and an answer has nothing to record.
    #[inline]
    pub fn quiet(&self) -> bool {
        (self.tripped.load(Relaxed) | self.failing.load(Relaxed)) == 0
    }

    /// Whether request `req_id` asks child i now. A child whose breaker is
    /// open is skipped; once its cooldown passed, the first request to ask
    /// becomes the probe and asks it.
    #[inline]
    pub fn admit(&self, i: usize, req_id: &str) -> bool {
        if self.tripped.load(Relaxed) & (1u64 << i) == 0 {
            return true;
        }
        let Some(Some(b)) = self.each.get(i) else {
            return true;
        };
        let mut inner = lock(&b.inner);
        match inner.state {
            State::Closed => true,
            State::Open => {
                if Instant::now() < inner.until {
                    return false;
                }
                inner.state = State::HalfOpen;
                inner.probe = Some(req_id.to_owned());
                self.push(Transition {
                    child: i,
                    from: State::Open,
                    to: State::HalfOpen,
                    cooldown: None,
                    probe: inner.probe.clone(),
                    failures: 0,
                });
                true
            }
            State::HalfOpen => match &inner.probe {
                Some(p) => p == req_id,
                None => {
                    inner.probe = Some(req_id.to_owned());
                    true
                }
            },
        }
    }

    /// Child i's lookup for `req_id` went `outcome`. True when this opened
    /// its breaker.
    #[inline]
    pub fn record(&self, i: usize, req_id: &str, outcome: Outcome) -> bool {
        // The usual case, inline: an answer from a closed breaker with no
        // failures to forget.
        let bit = 1u64 << i;
        if outcome == Outcome::Answered
            && (self.tripped.load(Relaxed) | self.failing.load(Relaxed)) & bit == 0
        {
            return false;
        }
        self.record_slow(i, req_id, outcome)
    }

    fn record_slow(&self, i: usize, req_id: &str, outcome: Outcome) -> bool {
        let Some(Some(b)) = self.each.get(i) else {
            return false;
        };
        let bit = 1u64 << i;
        let tripped = self.tripped.load(Relaxed) & bit != 0;
        match outcome {
            Outcome::Answered => {
                if self.failing.load(Relaxed) & bit != 0 {
                    self.failing.fetch_and(!bit, Relaxed);
                    b.failures.store(0, Relaxed);
                }
                if tripped {
                    let mut inner = lock(&b.inner);
                    if inner.state == State::HalfOpen && inner.probe.as_deref() == Some(req_id) {
                        self.close(i, b, &mut inner);
                    }
                }
                false
            }
            Outcome::Failed => {
                let mut inner = lock(&b.inner);
                match inner.state {
                    State::Closed => {
                        let run = b.failures.fetch_add(1, Relaxed) + 1;
                        self.failing.fetch_or(bit, Relaxed);
                        if run < b.cfg.failures {
                            return false;
                        }
                        self.open(i, b, &mut inner, State::Closed, run);
                        true
                    }
                    State::HalfOpen if inner.probe.as_deref() == Some(req_id) => {
                        inner.cooldown = inner.cooldown.saturating_mul(2).min(b.cfg.max_cooldown);
                        self.open(i, b, &mut inner, State::HalfOpen, 1);
                        true
                    }
                    // Failures of requests asked before it opened.
                    _ => false,
                }
            }
        }
    }

    /// Request `req_id` ended: if it was a probe, the next request probes.
    pub fn release(&self, req_id: &str) {
        let mut bits = self.tripped.load(Relaxed);
        while bits != 0 {
            let i = bits.trailing_zeros() as usize;
            bits &= bits - 1;
            if let Some(Some(b)) = self.each.get(i) {
                let mut inner = lock(&b.inner);
                if inner.state == State::HalfOpen && inner.probe.as_deref() == Some(req_id) {
                    inner.probe = None;
                }
            }
        }
    }

    fn open(&self, i: usize, b: &Breaker, inner: &mut Inner, from: State, failures: u32) {
        inner.state = State::Open;
        // A cooldown past what an Instant can hold is "open until the far
        // future", never a panic.
        let now = Instant::now();
        inner.until = now
            .checked_add(inner.cooldown)
            .unwrap_or_else(|| far_future(now));
        inner.probe = None;
        self.failing.fetch_and(!(1u64 << i), Relaxed);
        b.failures.store(0, Relaxed);
        self.tripped.fetch_or(1u64 << i, Relaxed);
        self.push(Transition {
            child: i,
            from,
            to: State::Open,
            cooldown: Some(inner.cooldown),
            probe: None,
            failures,
        });
    }

    fn close(&self, i: usize, b: &Breaker, inner: &mut Inner) {
        inner.state = State::Closed;
        inner.cooldown = b.cfg.cooldown;
        inner.probe = None;
        self.tripped.fetch_and(!(1u64 << i), Relaxed);
        self.push(Transition {
            child: i,
            from: State::HalfOpen,
            to: State::Closed,
            cooldown: None,
            probe: None,
            failures: 0,
        });
    }

    fn push(&self, t: Transition) {
        lock(&self.transitions).push(t);
        self.to_log.store(true, Relaxed);
        self.changed.store(true, Relaxed);
    }

    /// The transitions since the previous take, oldest first (to log).
    pub fn take_transitions(&self) -> Vec<Transition> {
        // A plain load first: the usual answer (nothing to log) writes nothing.
        if !self.to_log.load(Relaxed) || !self.to_log.swap(false, Relaxed) {
            return Vec::new();
        }
        std::mem::take(&mut *lock(&self.transitions))
    }

    /// Child i's state (None: no breaker). Open past its cooldown reads
    /// open until a request probes it.
    pub fn state(&self, i: usize) -> Option<State> {
        match self.each.get(i) {
            Some(Some(b)) => Some(lock(&b.inner).state),
            _ => None,
        }
    }

    /// Every child's state when some state changed since the previous
    /// call (for the gauge), else None.
    pub fn take_changed(&self) -> Option<Vec<Option<State>>> {
        self.changed
            .swap(false, Relaxed)
            .then(|| (0..self.each.len()).map(|i| self.state(i)).collect())
    }
}

/// The latest instant after `now` that adding to it reaches (a century
/// away, halved until it fits).
fn far_future(now: Instant) -> Instant {
    let mut d = Duration::from_secs(100 * 365 * 24 * 3600);
    loop {
        if let Some(t) = now.checked_add(d) {
            return t;
        }
        d /= 2;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread::sleep;

    fn breakers(failures: u32, cooldown_ms: u64) -> Breakers {
        Breakers::new(vec![
            Some(BreakerConfig {
                failures,
                cooldown: Duration::from_millis(cooldown_ms),
                max_cooldown: Duration::from_millis(cooldown_ms * 4),
            }),
            None,
        ])
    }

    fn states(b: &Breakers) -> Vec<State> {
        b.take_transitions().into_iter().map(|t| t.to).collect()
    }

    #[test]
    fn a_cooldown_past_any_instant_opens_for_the_far_future_without_panicking() {
        let b = Breakers::new(vec![Some(BreakerConfig {
            failures: 1,
            cooldown: Duration::MAX,
            max_cooldown: Duration::MAX,
        })]);
        assert!(b.record(0, "r", Outcome::Failed));
        assert_eq!(b.state(0), Some(State::Open));
        assert!(!b.admit(0, "s"));
    }

    #[test]
    fn opens_after_consecutive_failures_only() {
        let b = breakers(3, 1000);
        b.record(0, "a", Outcome::Failed);
        b.record(0, "b", Outcome::Failed);
        b.record(0, "c", Outcome::Answered);
        b.record(0, "d", Outcome::Failed);
        b.record(0, "e", Outcome::Failed);
        assert_eq!(b.state(0), Some(State::Closed));
        assert!(b.admit(0, "f"));
        b.record(0, "f", Outcome::Failed);
        assert_eq!(b.state(0), Some(State::Open));
        assert!(!b.admit(0, "g"));
        let t = b.take_transitions();
        assert_eq!(t.len(), 1, "one transition, logged once");
        assert_eq!(
            (t[0].from, t[0].to, t[0].failures),
            (State::Closed, State::Open, 3)
        );
        assert!(b.take_transitions().is_empty());
    }

    #[test]
    fn a_child_without_a_breaker_is_always_asked() {
        let b = breakers(1, 1000);
        for r in ["a", "b", "c"] {
            b.record(1, r, Outcome::Failed);
            assert!(b.admit(1, r));
        }
        assert_eq!(b.state(1), None);
        assert!(!b.any_tripped());
    }

    #[test]
    fn one_probe_after_the_cooldown_closes_it_on_an_answer() {
        let b = breakers(1, 20);
        b.record(0, "a", Outcome::Failed);
        assert!(!b.admit(0, "b"));
        sleep(Duration::from_millis(30));
        assert!(b.admit(0, "probe"));
        assert!(!b.admit(0, "other"), "only the probe asks");
        assert!(
            b.admit(0, "probe"),
            "the probe asks again on its next lookup"
        );
        b.record(0, "other", Outcome::Answered);
        assert_eq!(
            b.state(0),
            Some(State::HalfOpen),
            "only the probe's answer counts"
        );
        b.record(0, "probe", Outcome::Answered);
        assert_eq!(b.state(0), Some(State::Closed));
        assert!(b.admit(0, "other"));
        assert_eq!(states(&b), [State::Open, State::HalfOpen, State::Closed]);
    }

    #[test]
    fn a_failed_probe_doubles_the_cooldown_up_to_the_cap() {
        let b = breakers(1, 10);
        b.record(0, "a", Outcome::Failed);
        let mut cooldowns = vec![];
        for k in 0..4 {
            let t = b.take_transitions();
            let opened = t.iter().rev().find(|t| t.to == State::Open).unwrap();
            cooldowns.push(opened.cooldown.unwrap().as_millis());
            sleep(opened.cooldown.unwrap() + Duration::from_millis(5));
            let probe = format!("p{k}");
            assert!(b.admit(0, &probe));
            b.record(0, &probe, Outcome::Failed);
        }
        assert_eq!(cooldowns, [10, 20, 40, 40]);
        assert_eq!(b.state(0), Some(State::Open));
    }

    #[test]
    fn a_probe_that_ends_unanswered_hands_the_probe_on() {
        let b = breakers(1, 10);
        b.record(0, "a", Outcome::Failed);
        sleep(Duration::from_millis(15));
        assert!(b.admit(0, "probe"));
        assert!(!b.admit(0, "next"));
        b.release("probe");
        assert!(b.admit(0, "next"));
        b.record(0, "next", Outcome::Answered);
        assert_eq!(b.state(0), Some(State::Closed));
    }

    #[test]
    fn changed_states_are_reported_once_per_change() {
        let b = breakers(1, 1000);
        assert_eq!(b.take_changed(), None);
        b.record(0, "a", Outcome::Failed);
        assert_eq!(b.take_changed(), Some(vec![Some(State::Open), None]));
        assert_eq!(b.take_changed(), None);
    }
}
