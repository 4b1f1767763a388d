//! `load_decision: "cost"` and the per-request timeline: what the scheduler
//! side measures of each request ([`Timeline`]) and of each engine step
//! (`build_connector_meta` to `update_connector_output`: [`SchedulerMux::step_scheduled`],
//! [`SchedulerMux::step_done`]), and the decision ([`CostModel`]) applied
//! to a lookup's answers ([`SchedulerMux::lookup_about`]).
//!
//! Where each measurement comes from:
//!
//! - the engine's compute: a step's seconds (from its `build_connector_meta`,
//!   or the previous step's end if later, to its `update_connector_output`)
//!   over the tokens it scheduled, for steps that ran no synchronous load;
//! - an asynchronous load: allocation to the step whose output reports it
//!   finished receiving;
//! - a synchronous load: the seconds its step took beyond the compute fit's
//!   prediction for the step's tokens, split over the step's loads by tokens;
//! - a "not ready" wait: the child's first not-ready answer to its first
//!   ready one.

use std::collections::VecDeque;

use super::*;
use crate::mux::cost::{CostModel, Learned, Verdict, Why};
use crate::mux::requests::LoadPolicy;

/// Steps kept waiting for their output (vLLM runs at most a couple ahead).
const MAX_PENDING_STEPS: usize = 8;

/// What vLLM's request says of itself, read when kvmux measures.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct About {
    /// `Request.arrival_time` (epoch seconds).
    pub arrival: f64,
    pub prompt_tokens: u64,
}

/// One child's part of a [`Timeline`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ChildTimeline {
    /// Lookups it answered "not ready".
    pub not_ready: u32,
    /// Its first not-ready answer not yet followed by a ready one.
    pub waiting_since: Option<f64>,
    /// Seconds it was not ready (first not-ready answer to the ready one,
    /// or to when kvmux stopped waiting).
    pub not_ready_s: f64,
    /// Its span (or hit) at the latest ready lookup.
    pub tokens: Option<u64>,
    /// The load decision declined it, and why.
    pub declined: Option<Why>,
    /// Tokens it was given to load.
    pub load_tokens: u64,
    pub load_async: bool,
    pub load_start: Option<f64>,
    pub load_done: Option<f64>,
    /// Save admission declined its save of the request, and why.
    pub save_declined: Option<crate::mux::admit::Declined>,
}

/// Where one request's time went, from kvmux's own hooks (epoch seconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timeline {
    pub req_id: String,
    pub arrival: f64,
    pub prompt_tokens: u64,
    pub first_lookup: f64,
    /// Lookups vLLM made (each "not ready" answer costs an engine step).
    pub lookup_calls: u32,
    /// The first lookup answered with a count.
    pub ready: Option<f64>,
    pub local_hit_tokens: u64,
    pub children: Vec<ChildTimeline>,
    pub allocated: Option<f64>,
    pub external_tokens: u64,
    /// Prompt tokens computed or loaded so far (for `first_token`).
    pub computed: u64,
    /// The end of the step that computed its last prompt token.
    pub first_token: Option<f64>,
    pub finished: Option<f64>,
}

/// A step between its `build_connector_meta` and its output.
#[derive(Debug, Default)]
struct Step {
    at: f64,
    tokens: u64,
    /// Per child: tokens it loads synchronously in this step.
    sync: PerChild<u64>,
    /// Requests whose synchronous load runs in this step.
    sync_reqs: Vec<String>,
    /// Requests whose last prompt token this step computes.
    firsts: Vec<String>,
}

/// The steps in flight and what the next one will carry.
#[derive(Debug, Default)]
pub(super) struct Steps {
    pending: VecDeque<Step>,
    last_done: Option<f64>,
    /// Synchronous loads allocated since the last step was scheduled.
    sync: PerChild<u64>,
    sync_reqs: Vec<String>,
    /// Requests (with a timeline) whose first token is still to come.
    prefilling: Vec<String>,
}

/// The scheduler side's measuring state (present when the decision or the
/// timeline is on).
#[derive(Debug)]
pub(super) struct Measure {
    /// `load_decision: "cost"`: the model decides; else it only learns
    /// nothing and the timeline is kept.
    pub(super) decide: bool,
    /// Finished requests' timelines are handed out ([`SchedulerMux::take_timelines`]).
    pub(super) keep_timelines: bool,
    pub(super) model: Mutex<CostModel>,
    pub(super) steps: Mutex<Steps>,
    pub(super) done: Mutex<Vec<Timeline>>,
    pub(super) clock: fn() -> f64,
}

/// Seconds since the epoch (the clock of vLLM's `arrival_time`).
pub fn wall_clock() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl SchedulerMux {
    /// Turn on the cost-aware load decision (`decide`) and/or the
    /// per-request timeline (`timelines`: finished requests' timelines are
    /// kept for [`SchedulerMux::take_timelines`]); `clock`: epoch seconds.
    pub fn with_measure(mut self, decide: bool, timelines: bool, clock: fn() -> f64) -> Self {
        self.measure = (decide || timelines).then(|| {
            Box::new(Measure {
                decide,
                keep_timelines: timelines,
                model: Mutex::new(CostModel::new(self.names.len())),
                steps: Mutex::new(Steps::default()),
                done: Mutex::new(Vec::new()),
                clock,
            })
        });
        self
    }

    /// Whether lookups need [`About`] (the decision or the timeline is on).
    pub fn measuring(&self) -> bool {
        self.measure.is_some()
    }

    /// Whether the cost-aware load decision is on.
    pub fn deciding(&self) -> bool {
        self.measure.as_ref().is_some_and(|m| m.decide)
    }

    /// What the load decision has learned (None: measuring is off).
    pub fn learned(&self) -> Option<Learned> {
        Some(lock(&self.measure.as_ref()?.model).learned())
    }

    /// The timelines of requests finished since the last take.
    pub fn take_timelines(&self) -> Vec<Timeline> {
        match &self.measure {
            Some(m) if m.keep_timelines => std::mem::take(&mut *lock(&m.done)),
            _ => Vec::new(),
        }
    }

    /// `lookup_full`'s decision, after the children answered (`matches`):
    /// declined children become misses (a child not ready for too long is
    /// also out of the request's lookups, `excluded`). `unasked`: children
    /// `compose` did not ask this time.
    pub(super) fn decide(
        &self,
        req_id: &str,
        computed: u64,
        about: Option<About>,
        matches: &mut [ChildMatch],
        excluded: &mut u64,
        unasked: u64,
    ) -> PerChild<Option<(Why, u64)>> {
        let n = matches.len();
        let mut why: PerChild<Option<(Why, u64)>> = smallvec::smallvec![None; n];
        let Some(measure) = self.measure.as_deref().filter(|m| m.decide) else {
            return why;
        };
        let now = (measure.clock)();
        let (waiting, prompt) = self
            .table
            .with(req_id, |r| {
                let t = r.timeline.as_deref();
                let waiting: PerChild<Option<f64>> = (0..n)
                    .map(|i| t.and_then(|t| t.children.get(i)?.waiting_since))
                    .collect();
                (waiting, t.map(|t| t.prompt_tokens))
            })
            .unwrap_or_else(|| (smallvec::smallvec![None; n], None));
        let prompt = about.map(|a| a.prompt_tokens).or(prompt);
        let compose = self.load == LoadPolicy::Compose;
        let mut model = lock(&measure.model);
        let mut offset = 0u64;
        for i in 0..n {
            let bit = 1u64 << i;
            if unasked & bit != 0 || *excluded & bit != 0 {
                continue;
            }
            match matches[i].tokens {
                None => {
                    let Some(prompt) = prompt else { continue };
                    let waited = waiting[i].map_or(0.0, |s| (now - s).max(0.0));
                    // The most it could offer: the prompt tokens not yet
                    // computed nor offered by the children before it.
                    let max = prompt.saturating_sub(computed.saturating_add(offset));
                    let v = model.judge_wait(i, waited, max);
                    if v.measured() {
                        self.counters.child(i, Child::LoadDecisions, 1);
                    }
                    if let Verdict::Decline(w) = v {
                        if waited > 0.0 {
                            model.waited(i, waited);
                        }
                        matches[i] = MISS;
                        *excluded |= bit;
                        self.counters.child(i, Child::DeclinedWaits, 1);
                        if w == Why::SlowWait {
                            self.counters.child(i, Child::DeclinedSlowWaitTokens, max);
                        }
                        why[i] = Some((w, max));
                    }
                }
                Some(t) => {
                    if let Some(s) = waiting[i] {
                        model.waited(i, (now - s).max(0.0));
                    }
                    if compose {
                        offset = offset.saturating_add(t);
                    }
                }
            }
        }
        if matches.iter().any(|m| m.tokens.is_none()) {
            return why; // not ready yet: the spans are judged once all are
        }
        let mut verdicts: PerChild<Verdict> = smallvec::smallvec![Verdict::Unmeasured; n];
        if compose {
            let spans: PerChild<u64> = matches.iter().map(|m| m.tokens.unwrap_or(0)).collect();
            model.cut(&spans, &mut verdicts);
        } else {
            for (i, m) in matches.iter().enumerate() {
                verdicts[i] = model.judge(i, m.tokens.unwrap_or(0));
            }
        }
        drop(model);
        for (i, v) in verdicts.into_iter().enumerate() {
            if v.measured() {
                self.counters.child(i, Child::LoadDecisions, 1);
            }
            if let Verdict::Decline(w) = v {
                let t = matches[i].tokens.unwrap_or(0);
                self.counters.child(i, Child::DeclinedSlowLoadTokens, t);
                matches[i] = MISS;
                why[i] = Some((w, t));
            }
        }
        why
    }

    /// Record a lookup in the request's timeline (`matches`: the answers
    /// after the decision; `why`: what it declined, and the tokens
    /// declined; `asked`: children asked).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn note_lookup(
        &self,
        req_id: &str,
        computed: u64,
        about: Option<About>,
        matches: &[ChildMatch],
        why: &[Option<(Why, u64)>],
        answered: bool,
        asked: u64,
    ) {
        let Some(measure) = self.measure.as_deref() else {
            return;
        };
        let now = (measure.clock)();
        let n = matches.len();
        self.table.with_mut(req_id, |r| {
            let t = r.timeline.get_or_insert_with(|| {
                let a = about.unwrap_or_default();
                Box::new(Timeline {
                    req_id: req_id.to_owned(),
                    arrival: a.arrival,
                    prompt_tokens: a.prompt_tokens,
                    first_lookup: now,
                    children: vec![ChildTimeline::default(); n],
                    ..Timeline::default()
                })
            });
            t.lookup_calls += 1;
            for (i, c) in t.children.iter_mut().enumerate() {
                let bit = 1u64 << i;
                let declined = why.get(i).copied().flatten();
                match matches[i].tokens {
                    None if asked & bit != 0 => {
                        c.not_ready += 1;
                        c.waiting_since.get_or_insert(now);
                    }
                    None => {}
                    Some(tok) => {
                        if let Some(s) = c.waiting_since.take() {
                            c.not_ready_s += (now - s).max(0.0);
                        }
                        if let Some((w, t)) = declined {
                            // A declined child: the tokens declined.
                            c.declined = Some(w);
                            c.tokens = Some(t);
                        } else if asked & bit != 0 {
                            c.declined = None;
                            c.tokens = Some(tok);
                        }
                    }
                }
            }
            if answered && t.ready.is_none() {
                t.ready = Some(now);
                t.local_hit_tokens = computed;
            }
        });
    }

    /// Record an allocation: each child's share, when its load started;
    /// synchronous loads ride the next step. `async_loaders`: bit i, child
    /// i's load is asynchronous.
    pub(super) fn note_allocated(
        &self,
        req_id: &str,
        num_external: u64,
        given: &[u64],
        async_loaders: u64,
    ) {
        let Some(measure) = self.measure.as_deref() else {
            return;
        };
        let now = (measure.clock)();
        let mut sync: PerChild<u64> = smallvec::smallvec![0; given.len()];
        // Children that answered "not ready" and were waited for: what the
        // wait ended in (the tokens each was given), once per request.
        let mut yields: PerChild<(usize, u64)> = PerChild::new();
        let fresh = self
            .table
            .with_mut(req_id, |r| {
                let local = r.state.local_hit_tokens;
                let Some(t) = r.timeline.as_deref_mut() else {
                    return false;
                };
                if num_external == 0 && t.allocated.is_some() {
                    return false; // vLLM's second call, after an async load
                }
                if t.allocated.is_none() && measure.decide {
                    for (i, c) in t.children.iter().enumerate() {
                        let waited_for = !matches!(c.declined, Some(Why::SlowWait | Why::NoYield));
                        if c.not_ready > 0 && waited_for {
                            yields.push((i, given.get(i).copied().unwrap_or(0)));
                        }
                    }
                }
                t.allocated = Some(now);
                t.external_tokens = num_external;
                t.computed = local + num_external;
                for (i, c) in t.children.iter_mut().enumerate() {
                    let g = given.get(i).copied().unwrap_or(0);
                    if g == 0 {
                        continue;
                    }
                    c.load_tokens = g;
                    c.load_async = async_loaders & (1u64 << i) != 0;
                    c.load_start = Some(now);
                    c.load_done = None;
                    if !c.load_async {
                        sync[i] = g;
                    }
                }
                t.first_token.is_none()
            })
            .unwrap_or(false);
        if !yields.is_empty() {
            let mut model = lock(&measure.model);
            for (i, g) in yields {
                model.yielded(i, g);
            }
        }
        if !fresh {
            return;
        }
        let mut steps = lock(&measure.steps);
        if sync.iter().any(|&g| g > 0) {
            if steps.sync.len() < sync.len() {
                steps.sync.resize(sync.len(), 0);
            }
            for (i, g) in sync.iter().enumerate() {
                steps.sync[i] += g;
            }
            steps.sync_reqs.push(req_id.to_owned());
        }
        if !steps.prefilling.iter().any(|r| r == req_id) {
            steps.prefilling.push(req_id.to_owned());
        }
    }

    /// `update_connector_output`: the asynchronous loads of `recving`
    /// (live requests) ended now.
    pub(super) fn note_received<S: AsRef<str>>(&self, recving: &[S]) {
        let Some(measure) = self.measure.as_deref() else {
            return;
        };
        let now = (measure.clock)();
        let mut ended: Vec<(usize, u64, f64)> = Vec::new();
        for id in recving {
            self.table.with_mut(id.as_ref(), |r| {
                let Some(t) = r.timeline.as_deref_mut() else {
                    return;
                };
                for (i, c) in t.children.iter_mut().enumerate() {
                    if c.load_async && c.load_done.is_none() {
                        if let Some(s) = c.load_start {
                            c.load_done = Some(now);
                            ended.push((i, c.load_tokens, (now - s).max(0.0)));
                        }
                    }
                }
            });
        }
        if measure.decide && !ended.is_empty() {
            let mut model = lock(&measure.model);
            for (i, tokens, secs) in ended {
                model.loaded(i, tokens, secs);
            }
        }
    }

    /// `build_connector_meta`: a step scheduling `tokens` was built;
    /// `scheduled(req_id)`: the tokens it schedules for a request (None:
    /// not in the step).
    pub fn step_scheduled(&self, tokens: u64, mut scheduled: impl FnMut(&str) -> Option<u64>) {
        let Some(measure) = self.measure.as_deref() else {
            return;
        };
        let now = (measure.clock)();
        let mut steps = lock(&measure.steps);
        let mut step = Step {
            at: now,
            tokens,
            sync: std::mem::take(&mut steps.sync),
            sync_reqs: std::mem::take(&mut steps.sync_reqs),
            firsts: Vec::new(),
        };
        let mut still = Vec::with_capacity(steps.prefilling.len());
        for id in std::mem::take(&mut steps.prefilling) {
            let Some(n) = scheduled(&id) else {
                if self.table.with(&id, |_| ()).is_some() {
                    still.push(id);
                }
                continue;
            };
            let first = self
                .table
                .with_mut(&id, |r| {
                    let t = r.timeline.as_deref_mut()?;
                    t.computed = t.computed.saturating_add(n);
                    Some(t.computed >= t.prompt_tokens)
                })
                .flatten();
            match first {
                Some(true) => step.firsts.push(id),
                Some(false) => still.push(id),
                None => {}
            }
        }
        steps.prefilling = still;
        if steps.pending.len() >= MAX_PENDING_STEPS {
            steps.pending.pop_front();
        }
        steps.pending.push_back(step);
    }

    /// `update_connector_output`: the oldest step in flight ended.
    pub fn step_done(&self) {
        let Some(measure) = self.measure.as_deref() else {
            return;
        };
        let now = (measure.clock)();
        let (step, began) = {
            let mut steps = lock(&measure.steps);
            let Some(step) = steps.pending.pop_front() else {
                return;
            };
            let began = steps.last_done.map_or(step.at, |d| d.max(step.at));
            steps.last_done = Some(now);
            (step, began)
        };
        let secs = (now - began).max(0.0);
        let sync_total: u64 = step.sync.iter().sum();
        if measure.decide && step.tokens > 0 {
            let mut model = lock(&measure.model);
            if sync_total == 0 {
                model.step(step.tokens, secs);
            } else if let Some(compute) = model.compute_secs(step.tokens) {
                // What the step took beyond computing its tokens, split
                // over its loads by tokens.
                let extra = (secs - compute).max(0.0);
                for (i, &g) in step.sync.iter().enumerate().filter(|(_, &g)| g > 0) {
                    model.loaded(i, g, extra * g as f64 / sync_total as f64);
                }
            }
        }
        for id in step.sync_reqs {
            self.table.with_mut(&id, |r| {
                if let Some(t) = r.timeline.as_deref_mut() {
                    for c in t.children.iter_mut() {
                        if !c.load_async && c.load_start.is_some() && c.load_done.is_none() {
                            c.load_done = Some(now);
                        }
                    }
                }
            });
        }
        for id in step.firsts {
            self.table.with_mut(&id, |r| {
                if let Some(t) = r.timeline.as_deref_mut() {
                    t.first_token.get_or_insert(now);
                }
            });
        }
    }

    /// A finished request's timeline is kept for the next take.
    pub(super) fn note_finished(&self, timeline: Option<Box<Timeline>>) {
        let (Some(measure), Some(mut t)) = (self.measure.as_deref(), timeline) else {
            return;
        };
        if !measure.keep_timelines {
            return;
        }
        t.finished = Some((measure.clock)());
        for c in t.children.iter_mut() {
            if let Some(s) = c.waiting_since.take() {
                c.not_ready_s += (t.finished.unwrap_or(s) - s).max(0.0);
            }
        }
        lock(&measure.done).push(*t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mux::cost::PROBE_EVERY;
    use crate::mux::scheduler::test_support::*;
    use std::cell::Cell;

    thread_local! {
        static NOW: Cell<f64> = const { Cell::new(1000.0) };
    }

    fn clock() -> f64 {
        NOW.with(Cell::get)
    }

    fn advance(s: f64) {
        NOW.with(|c| c.set(c.get() + s));
    }

    fn about(prompt_tokens: u64) -> Option<About> {
        Some(About {
            arrival: clock(),
            prompt_tokens,
        })
    }

    /// A deciding multiplexer whose engine computes a prompt token in 1 ms
    /// (plus 5 ms a step), measured through its step hooks.
    fn deciding(n: usize, load: LoadPolicy) -> SchedulerMux {
        let m = mux(n, ClashPolicy::Error, load).with_measure(true, true, clock);
        for tokens in [64u64, 512, 2048, 128, 1024] {
            m.step_scheduled(tokens, |_| None);
            advance(0.005 + 0.001 * tokens as f64);
            m.step_done();
        }
        m
    }

    fn child_async(tokens: u64) -> R<ChildMatch> {
        Ok(ChildMatch {
            tokens: Some(tokens),
            load_async: true,
        })
    }

    fn not_ready() -> R<ChildMatch> {
        Ok(ChildMatch {
            tokens: None,
            load_async: false,
        })
    }

    /// One request whose child-1 async load of `tokens` takes `secs`
    /// (allocation to the output reporting it received), then finishes.
    fn remote_load(m: &SchedulerMux, req: &str, tokens: u64, secs: f64) -> Option<u64> {
        let got = m
            .lookup_about(req, 0, about(tokens + 16), |i, _| {
                if i == 1 {
                    child_async(tokens)
                } else {
                    hit(0)
                }
            })
            .unwrap();
        if got.tokens == Some(tokens) {
            m.allocated(req, tokens, no_blocks, no_tell).unwrap();
            advance(secs);
            m.reported(&[req], &[]);
        } else {
            m.allocated(req, 0, no_blocks, no_tell).unwrap();
        }
        finish_with(m, req, false, vec![done(false, None), done(false, None)]).unwrap();
        got.tokens
    }

    fn count(m: &SchedulerMux, i: usize, c: Child) -> u64 {
        m.snapshot().children[i][c as usize]
    }

    #[test]
    fn a_child_whose_loads_turn_slower_than_computing_is_declined_then_probed_and_taken_again() {
        let m = deciding(2, LoadPolicy::First);
        // Fast loads (0.1 ms a token, 10x faster than computing): taken.
        for k in 0..4 {
            assert_eq!(remote_load(&m, &format!("fast{k}"), 1024, 0.1), Some(1024));
        }
        // The child turns slow (3 ms a token): within a few requests its
        // spans are declined, and the request computes them.
        let mut declined_at = None;
        for k in 0..6 {
            if remote_load(&m, &format!("slow{k}"), 1024, 3.0) == Some(0) {
                declined_at = Some(k);
                break;
            }
        }
        assert!(declined_at.is_some_and(|k| k <= 3), "{declined_at:?}");
        assert!(count(&m, 1, Child::DeclinedSlowLoadTokens) >= 1024);
        // It recovers: the probe (every PROBE_EVERY-th decline) measures it
        // fast again, and it is taken again.
        let mut taken_at = None;
        for k in 0..4 * PROBE_EVERY as usize {
            if remote_load(&m, &format!("back{k}"), 1024, 0.1) == Some(1024) {
                let next = remote_load(&m, &format!("next{k}"), 1024, 0.1);
                if next == Some(1024) {
                    taken_at = Some(k);
                    break;
                }
            }
        }
        assert!(taken_at.is_some(), "a recovered child is taken again");
        assert!(count(&m, 1, Child::LoadDecisions) > 0);
        assert_eq!(m.live_requests(), 0);
    }

    #[test]
    fn with_the_decision_off_the_same_slow_child_is_always_taken() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First).with_measure(false, true, clock);
        for k in 0..12 {
            assert_eq!(remote_load(&m, &format!("r{k}"), 1024, 3.0), Some(1024));
        }
        assert_eq!(count(&m, 1, Child::LoadDecisions), 0);
        assert_eq!(count(&m, 1, Child::DeclinedSlowLoadTokens), 0);
    }

    #[test]
    fn a_not_ready_child_is_not_waited_for_longer_than_computing_its_tokens() {
        let m = deciding(2, LoadPolicy::First);
        // 512 prompt tokens compute in about 0.5 s.
        let ask = |m: &SchedulerMux| {
            m.lookup_about("r", 0, about(512), |i, _| {
                if i == 1 {
                    not_ready()
                } else {
                    hit(0)
                }
            })
            .unwrap()
            .tokens
        };
        assert_eq!(ask(&m), None, "waited for at first");
        advance(0.2);
        assert_eq!(ask(&m), None, "still cheaper to wait");
        advance(0.4);
        assert_eq!(
            ask(&m),
            Some(0),
            "computing would be done by now: not waited for"
        );
        assert_eq!(count(&m, 1, Child::DeclinedSlowWaitTokens), 512);
        // Out of this request's lookups: its late answer never counts.
        let again = m
            .lookup_about("r", 0, about(512), |i, _| {
                assert_ne!(i, 1, "a declined not-ready child is not asked again");
                hit(0)
            })
            .unwrap();
        assert_eq!(again.tokens, Some(0));
        m.allocated("r", 0, no_blocks, no_tell).unwrap();
        finish_with(&m, "r", false, vec![done(false, None), done(false, None)]).unwrap();
        let t = &m.take_timelines()[0];
        assert_eq!(t.children[1].declined, Some(Why::SlowWait));
        assert_eq!(t.children[1].not_ready, 2);
        assert!((t.children[1].not_ready_s - 0.6).abs() < 1e-6);
    }

    #[test]
    fn compose_declines_the_slow_tail_span_and_keeps_the_fast_head() {
        let m = deciding(2, LoadPolicy::Compose);
        // Child 1's loads are slow (4 ms a token), measured on requests
        // where it loads alone.
        for k in 0..4 {
            remote_load(&m, &format!("slow{k}"), 512, 2.0);
        }
        let got = m
            .lookup_about("r", 0, about(2048), |i, _| {
                if i == 0 {
                    hit(1024)
                } else {
                    child_async(512)
                }
            })
            .unwrap();
        assert_eq!(got.tokens, Some(1024), "the host span only");
        assert!(!got.load_async);
        let mut told = vec![];
        m.allocated("r", 1024, no_blocks, |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
        assert_eq!(told, [(0, 1024), (1, 0)]);
        assert!(count(&m, 1, Child::DeclinedSlowLoadTokens) >= 512);
        assert_eq!(count(&m, 0, Child::DeclinedSlowLoadTokens), 0);
    }

    #[test]
    fn the_timeline_says_where_a_requests_time_went() {
        let m = mux(2, ClashPolicy::Error, LoadPolicy::First).with_measure(false, true, clock);
        let t0 = clock();
        let a = about(1040);
        advance(0.01);
        // Child 1 is not ready for one step, then offers 1024 tokens.
        m.lookup_about("r", 0, a, |i, _| if i == 1 { not_ready() } else { hit(0) })
            .unwrap();
        advance(0.3);
        m.lookup_about(
            "r",
            0,
            a,
            |i, _| if i == 1 { child_async(1024) } else { hit(0) },
        )
        .unwrap();
        advance(0.02);
        m.allocated("r", 1024, no_blocks, no_tell).unwrap();
        advance(0.1);
        m.reported(&["r"], &[]);
        // The step that computes the last 16 prompt tokens.
        m.step_scheduled(16, |id| (id == "r").then_some(16));
        advance(0.05);
        m.step_done();
        finish_with(&m, "r", false, vec![done(false, None), done(false, None)]).unwrap();
        let got = m.take_timelines();
        assert_eq!(got.len(), 1);
        let t = &got[0];
        let close = |a: f64, b: f64| (a - b).abs() < 1e-6;
        assert!(close(t.arrival, t0));
        assert_eq!(t.prompt_tokens, 1040);
        assert!(close(t.first_lookup, t0 + 0.01));
        assert_eq!(t.lookup_calls, 2);
        assert!(close(t.ready.unwrap(), t0 + 0.31));
        assert!(close(t.allocated.unwrap(), t0 + 0.33));
        let c = &t.children[1];
        assert_eq!(
            (c.not_ready, c.tokens, c.load_tokens),
            (1, Some(1024), 1024)
        );
        assert!(close(c.not_ready_s, 0.3));
        assert!(c.load_async);
        assert!(close(c.load_done.unwrap() - c.load_start.unwrap(), 0.1));
        assert!(close(t.first_token.unwrap(), t0 + 0.48));
        assert!(t.finished.is_some());
        assert!(m.take_timelines().is_empty(), "taken once");
        assert!(m.learned().is_some());
    }

    #[test]
    fn a_sync_load_is_measured_as_what_its_step_took_beyond_computing() {
        let m = deciding(2, LoadPolicy::First);
        for k in 0..4 {
            let r = format!("r{k}");
            m.lookup_about(&r, 0, about(1040), |i, _| {
                hit(if i == 0 { 1024 } else { 0 })
            })
            .unwrap();
            m.allocated(&r, 1024, no_blocks, no_tell).unwrap();
            // The step computes 16 tokens (21 ms) and loads 1024 (+200 ms).
            m.step_scheduled(16, |id| (id == r).then_some(16));
            advance(0.005 + 0.016 + 0.2);
            m.step_done();
            finish_with(&m, &r, false, vec![done(false, None), done(false, None)]).unwrap();
        }
        let (a, b) = m.learned().unwrap().load[0].unwrap();
        let est = a + b * 1024.0;
        assert!((est - 0.205).abs() < 0.01, "{est}");
    }
}
