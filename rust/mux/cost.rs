//! The cost-aware load decision (`load_decision: "cost"`): what loading a
//! child's span is expected to cost, learned online from what kvmux sees,
//! against what computing the same prompt tokens costs on this instance.
//!
//! Three things are learned, each weighting recent observations more
//! ([`Fit`], [`Mean`]: every new observation multiplies the older ones'
//! weight by a decay, so a child that turns slow, or recovers, is followed
//! within a handful of requests):
//!
//! - the engine's compute: seconds per engine step over the tokens it
//!   scheduled (`a + b n`; `b` is what one more prompt token costs);
//! - per child, a load: seconds from allocation to the load's end over the
//!   tokens loaded (`a` per request, `b` per token);
//! - per child, a "not ready" wait: seconds from its first not-ready answer
//!   to its first ready one, per request that waited.
//!
//! The rule ([`CostModel::judge`], [`CostModel::judge_wait`],
//! [`CostModel::cut`]): a span is taken when loading it is expected to be
//! faster than computing it; a child that is not ready is waited for only
//! while waiting, then loading the most it could offer, is expected to be
//! faster than computing that; under `compose` the spans taken are the
//! prefix of spans with the least expected time. Without measurements of
//! both sides the answer is to take (what kvmux does with the decision
//! off). A declined child is still taken every [`PROBE_EVERY`]-th time in
//! a row, so that its costs keep being measured and a child that recovers
//! is taken again.

/// The values of `load_decision`: `always` loads whatever hits (kvmux
/// without the decision), `cost` decides per request with [`CostModel`].
pub const LOAD_DECISIONS: [&str; 2] = ["always", "cost"];

/// Whether `load_decision` names the cost-aware decision (None: not a
/// value of [`LOAD_DECISIONS`]).
pub fn decides(load_decision: &str) -> Option<bool> {
    match load_decision {
        "always" => Some(false),
        "cost" => Some(true),
        _ => None,
    }
}

/// Observations a [`Fit`] or [`Mean`] needs before it answers.
pub const MIN_SAMPLES: u64 = 3;
/// A child declined this many times in a row is taken once (a probe).
pub const PROBE_EVERY: u32 = 8;
/// Decay per observation of the engine's compute fit (steps are many).
pub const STEP_DECAY: f64 = 0.95;
/// Decay per observation of a child's load and wait (requests are fewer).
pub const LOAD_DECAY: f64 = 0.5;

/// An online least-squares fit of `y = a + b x`, older observations
/// weighted down by `decay` per new one.
#[derive(Clone, Debug)]
pub struct Fit {
    decay: f64,
    w: f64,
    sx: f64,
    sy: f64,
    sxx: f64,
    sxy: f64,
    n: u64,
}

impl Fit {
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            w: 0.0,
            sx: 0.0,
            sy: 0.0,
            sxx: 0.0,
            sxy: 0.0,
            n: 0,
        }
    }

    /// One observation: `y` seconds for `x` tokens. Not finite or negative
    /// values are ignored.
    pub fn observe(&mut self, x: f64, y: f64) {
        if !(x.is_finite() && y.is_finite() && x >= 0.0 && y >= 0.0) {
            return;
        }
        let d = self.decay;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sy = self.sy * d + y;
        self.sxx = self.sxx * d + x * x;
        self.sxy = self.sxy * d + x * y;
        self.n += 1;
    }

    pub fn samples(&self) -> u64 {
        self.n
    }

    /// `(a, b)`, both at least 0; None before [`MIN_SAMPLES`]. With too
    /// little spread in `x` to tell `a` from `b` (e.g. spans of one size),
    /// the line through the origin and the mean.
    pub fn line(&self) -> Option<(f64, f64)> {
        if self.n < MIN_SAMPLES || self.w <= 0.0 {
            return None;
        }
        let (mx, my) = (self.sx / self.w, self.sy / self.w);
        let var = self.sxx / self.w - mx * mx;
        let through_origin = || {
            if self.sxx > 0.0 {
                (0.0, (self.sxy / self.sxx).max(0.0))
            } else {
                (my, 0.0)
            }
        };
        if var <= (0.05 * mx).powi(2) {
            return Some(through_origin());
        }
        let b = (self.sxy / self.w - mx * my) / var;
        if b < 0.0 {
            // Not a cost that grows with size: the mean, per request.
            return Some((my, 0.0));
        }
        let a = my - b * mx;
        if a < 0.0 {
            return Some(through_origin());
        }
        Some((a, b))
    }

    /// The fitted seconds for `x` tokens.
    pub fn predict(&self, x: f64) -> Option<f64> {
        self.line().map(|(a, b)| a + b * x)
    }
}

/// An online mean, older observations weighted down by `decay` per new one.
#[derive(Clone, Debug)]
pub struct Mean {
    decay: f64,
    w: f64,
    s: f64,
    n: u64,
}

impl Mean {
    pub fn new(decay: f64) -> Self {
        Self {
            decay,
            w: 0.0,
            s: 0.0,
            n: 0,
        }
    }

    pub fn observe(&mut self, y: f64) {
        if !(y.is_finite() && y >= 0.0) {
            return;
        }
        self.w = self.w * self.decay + 1.0;
        self.s = self.s * self.decay + y;
        self.n += 1;
    }

    /// None before [`MIN_SAMPLES`].
    pub fn get(&self) -> Option<f64> {
        (self.n >= MIN_SAMPLES && self.w > 0.0).then(|| self.s / self.w)
    }
}

/// Why a span was declined.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Why {
    /// Loading it was expected to be slower than computing it.
    SlowLoad,
    /// The child's "not ready" wait was expected to be (or was already)
    /// longer than computing what it could offer.
    SlowWait,
    /// The child's recent "not ready" answers rarely ended in tokens it
    /// loaded: what they served was worth less than the wait they cost.
    NoYield,
}

impl Why {
    pub fn as_str(self) -> &'static str {
        match self {
            Why::SlowLoad => "slow_load",
            Why::SlowWait => "slow_wait",
            Why::NoYield => "no_yield",
        }
    }
}

/// The decision on one child's span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// Too few measurements: taken, as with the decision off.
    Unmeasured,
    /// Expected faster than computing: taken.
    Take,
    /// Expected slower, taken anyway to measure it again
    /// ([`PROBE_EVERY`]).
    Probe(Why),
    /// Expected slower: declined.
    Decline(Why),
}

impl Verdict {
    pub fn takes(self) -> bool {
        !matches!(self, Verdict::Decline(_))
    }
    /// Judged with measurements (counted as a decision).
    pub fn measured(self) -> bool {
        !matches!(self, Verdict::Unmeasured)
    }
}

/// What is learned per child and of the engine, and the rule.
#[derive(Clone, Debug)]
pub struct CostModel {
    compute: Fit,
    loads: Vec<Fit>,
    waits: Vec<Mean>,
    /// Per child: the tokens it loaded for a request after answering it
    /// "not ready" (0 when the wait ended in a miss or another child's
    /// load), per request that waited.
    yields: Vec<Mean>,
    /// Per child: declines in a row since its last take.
    declined_in_a_row: Vec<u32>,
}

/// A summary of what the model has learned (for stats and tests).
#[derive(Clone, Debug, PartialEq)]
pub struct Learned {
    /// Seconds per computed prompt token (None: not measured yet).
    pub compute_per_token: Option<f64>,
    /// Per child: `(seconds per request, seconds per token)` of a load.
    pub load: Vec<Option<(f64, f64)>>,
    /// Per child: mean "not ready" seconds of a request that waited.
    pub wait: Vec<Option<f64>>,
    /// Per child: mean tokens it loaded after a "not ready" answer.
    pub wait_yield: Vec<Option<f64>>,
}

impl CostModel {
    pub fn new(n_children: usize) -> Self {
        Self {
            compute: Fit::new(STEP_DECAY),
            loads: (0..n_children).map(|_| Fit::new(LOAD_DECAY)).collect(),
            waits: (0..n_children).map(|_| Mean::new(LOAD_DECAY)).collect(),
            yields: (0..n_children).map(|_| Mean::new(LOAD_DECAY)).collect(),
            declined_in_a_row: vec![0; n_children],
        }
    }

    /// An engine step computed `tokens` in `secs`.
    pub fn step(&mut self, tokens: u64, secs: f64) {
        self.compute.observe(tokens as f64, secs);
    }

    /// Child `i` loaded `tokens` in `secs` (from allocation to its end).
    pub fn loaded(&mut self, i: usize, tokens: u64, secs: f64) {
        if let Some(f) = self.loads.get_mut(i) {
            f.observe(tokens as f64, secs);
        }
    }

    /// Child `i` answered "not ready" for `secs` before it was ready (or
    /// before kvmux stopped waiting) on one request.
    pub fn waited(&mut self, i: usize, secs: f64) {
        if let Some(m) = self.waits.get_mut(i) {
            m.observe(secs);
        }
    }

    /// A request child `i` answered "not ready" ended with `tokens` loaded
    /// from it (0: a miss, or another child loaded).
    pub fn yielded(&mut self, i: usize, tokens: u64) {
        if let Some(m) = self.yields.get_mut(i) {
            m.observe(tokens as f64);
        }
    }

    /// Seconds the engine is expected to spend computing `tokens` more
    /// prompt tokens (the fit's slope: the per-step part is paid anyway).
    pub fn compute_secs(&self, tokens: u64) -> Option<f64> {
        self.compute.line().map(|(_, b)| b * tokens as f64)
    }

    /// Seconds child `i` is expected to take to load `tokens`.
    pub fn load_secs(&self, i: usize, tokens: u64) -> Option<f64> {
        self.loads.get(i)?.predict(tokens as f64)
    }

    pub fn learned(&self) -> Learned {
        Learned {
            compute_per_token: self.compute.line().map(|(_, b)| b),
            load: self.loads.iter().map(Fit::line).collect(),
            wait: self.waits.iter().map(Mean::get).collect(),
            wait_yield: self.yields.iter().map(Mean::get).collect(),
        }
    }

    /// A declined child's turn: declined, or every [`PROBE_EVERY`]-th time
    /// in a row taken as a probe.
    fn declined(&mut self, i: usize, why: Why) -> Verdict {
        let n = &mut self.declined_in_a_row[i];
        *n += 1;
        if *n >= PROBE_EVERY {
            *n = 0;
            Verdict::Probe(why)
        } else {
            Verdict::Decline(why)
        }
    }

    fn taken(&mut self, i: usize, v: Verdict) -> Verdict {
        if v == Verdict::Take {
            self.declined_in_a_row[i] = 0;
        }
        v
    }

    /// Child `i` offers `tokens` ready to load: take them when loading is
    /// expected to be faster than computing them.
    pub fn judge(&mut self, i: usize, tokens: u64) -> Verdict {
        if tokens == 0 || i >= self.loads.len() {
            return Verdict::Unmeasured;
        }
        let (Some(load), Some(compute)) = (self.load_secs(i, tokens), self.compute_secs(tokens))
        else {
            return Verdict::Unmeasured;
        };
        if load < compute {
            self.taken(i, Verdict::Take)
        } else {
            self.declined(i, Why::SlowLoad)
        }
    }

    /// Child `i` is not ready after `waited` seconds; it could offer at
    /// most `max_tokens`. Wait for it while the wait (what it usually takes,
    /// or what it took already if longer) and then its load are expected to
    /// be faster than computing `max_tokens`, and, at its first not-ready
    /// answer of the request, while its recent waits ended in tokens worth
    /// the wait ([`CostModel::yielded`]: the compute of what it then loaded,
    /// less the load). Never waits longer than computing them takes. Before
    /// the wait is measured: wait.
    pub fn judge_wait(&mut self, i: usize, waited: f64, max_tokens: u64) -> Verdict {
        if i >= self.waits.len() {
            return Verdict::Unmeasured;
        }
        let Some(compute) = self.compute_secs(max_tokens) else {
            return Verdict::Unmeasured;
        };
        if waited >= compute {
            // Computing would have been done by now: no probe, the bound
            // holds for every request.
            self.declined_in_a_row[i] = 0;
            return Verdict::Decline(Why::SlowWait);
        }
        let Some(wait) = self.waits[i].get() else {
            return Verdict::Unmeasured;
        };
        let load = self.load_secs(i, max_tokens).unwrap_or(0.0);
        if wait.max(waited) + load >= compute {
            return self.declined(i, Why::SlowWait);
        }
        // At its first "not ready" answer of a request (`waited` 0; once a
        // request waits for it, a probe included, only the bounds above
        // apply): what its recent waits ended in, the compute of the tokens
        // it then loaded less their load, against the wait to come.
        if waited > 0.0 {
            return Verdict::Take;
        }
        if let Some(tokens) = self.yields[i].get() {
            let per_token = compute / max_tokens.max(1) as f64;
            let t = tokens.round() as u64;
            let gain = per_token * tokens - self.load_secs(i, t).unwrap_or(0.0);
            if gain <= (wait - waited).max(0.0) {
                return self.declined(i, Why::NoYield);
            }
        }
        Verdict::Take
    }

    /// `compose`: the children's spans in order (`spans[j]`: child j's
    /// tokens). The number of leading spans to take (`k`: spans `k..` are
    /// computed instead) with the least expected time: loading spans
    /// `..k` plus computing the tokens of spans `k..`; unmeasured loads
    /// cost nothing (taken, as with the decision off). Each span's verdict
    /// is in `out` (`Unmeasured` for empty spans).
    pub fn cut(&mut self, spans: &[u64], out: &mut [Verdict]) -> usize {
        let m = spans.len();
        let Some(per_token) = self.compute.line().map(|(_, b)| b) else {
            out.iter_mut().for_each(|v| *v = Verdict::Unmeasured);
            return m;
        };
        // Expected time of cut k, for k = 0..=m.
        let total: u64 = spans.iter().sum();
        let (mut best, mut best_t) = (0, per_token * total as f64);
        let (mut loaded, mut rest) = (0.0, total);
        for (j, &n) in spans.iter().enumerate() {
            if n > 0 {
                loaded += self.load_secs(j, n).unwrap_or(0.0);
            }
            rest -= n;
            let t = loaded + per_token * rest as f64;
            // Ties go to loading (what the decision off does).
            if t <= best_t {
                best = j + 1;
                best_t = t;
            }
        }
        let mut k = best;
        // The first declined child's probe, if due, takes the rest too.
        if let Some(first) = (k..m).find(|&j| spans[j] > 0) {
            if matches!(self.declined(first, Why::SlowLoad), Verdict::Probe(_)) {
                for j in k..m {
                    out[j] = if spans[j] > 0 {
                        Verdict::Probe(Why::SlowLoad)
                    } else {
                        Verdict::Unmeasured
                    };
                }
                k = m;
            } else {
                for j in k..m {
                    out[j] = if spans[j] > 0 {
                        Verdict::Decline(Why::SlowLoad)
                    } else {
                        Verdict::Unmeasured
                    };
                }
                // `declined` counted the first; the others count too.
                for j in (first + 1..m).filter(|&j| spans[j] > 0) {
                    self.declined_in_a_row[j] += 1;
                }
            }
        }
        for j in 0..best.min(m) {
            out[j] = if spans[j] == 0 {
                Verdict::Unmeasured
            } else if self.load_secs(j, spans[j]).is_some() {
                self.taken(j, Verdict::Take)
            } else {
                Verdict::Unmeasured
            };
        }
        k
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An engine that computes a prompt token in 1 ms, plus 5 ms a step.
    fn engine() -> CostModel {
        let mut m = CostModel::new(2);
        for n in [64u64, 512, 2048, 128, 1024, 32] {
            m.step(n, 0.005 + 0.001 * n as f64);
        }
        m
    }

    fn loads(m: &mut CostModel, i: usize, per_token: f64, fixed: f64) {
        for n in [256u64, 1024, 512, 2048] {
            m.loaded(i, n, fixed + per_token * n as f64);
        }
    }

    #[test]
    fn the_fit_recovers_a_line_and_a_mean() {
        let mut f = Fit::new(1.0);
        assert_eq!(f.predict(10.0), None, "no answer before MIN_SAMPLES");
        for x in [1.0, 2.0, 3.0, 4.0] {
            f.observe(x, 2.0 + 3.0 * x);
        }
        let (a, b) = f.line().unwrap();
        assert!((a - 2.0).abs() < 1e-9 && (b - 3.0).abs() < 1e-9, "{a} {b}");
        // One size only: the line through the origin and the mean.
        let mut g = Fit::new(1.0);
        for _ in 0..4 {
            g.observe(100.0, 0.5);
        }
        assert_eq!(g.line(), Some((0.0, 0.005)));
        // Garbage is ignored.
        g.observe(f64::NAN, 1.0);
        g.observe(1.0, -1.0);
        assert_eq!(g.samples(), 4);
    }

    #[test]
    fn the_engines_cost_per_token_is_the_slope_of_its_steps() {
        let m = engine();
        let c = m.compute_secs(1000).unwrap();
        assert!((c - 1.0).abs() < 1e-6, "{c}");
        assert!((m.learned().compute_per_token.unwrap() - 0.001).abs() < 1e-9);
    }

    #[test]
    fn before_measurements_every_span_is_taken() {
        let mut m = CostModel::new(2);
        assert_eq!(m.judge(0, 1024), Verdict::Unmeasured);
        assert_eq!(m.judge_wait(0, 100.0, 1024), Verdict::Unmeasured);
        let mut out = [Verdict::Take; 2];
        assert_eq!(m.cut(&[512, 512], &mut out), 2);
        // The engine measured but not the child: still taken.
        let mut m = engine();
        assert_eq!(m.judge(1, 1024), Verdict::Unmeasured);
    }

    #[test]
    fn a_load_faster_than_compute_is_taken_a_slower_one_declined() {
        let mut m = engine();
        loads(&mut m, 0, 0.0001, 0.002); // 10x faster than computing
        loads(&mut m, 1, 0.002, 0.050); // 2x slower
        assert_eq!(m.judge(0, 1024), Verdict::Take);
        assert_eq!(m.judge(1, 1024), Verdict::Decline(Why::SlowLoad));
        // A small span: the per-request cost of child 0 (2 ms) beats
        // computing 1 token (1 ms): declined.
        assert_eq!(m.judge(0, 1), Verdict::Decline(Why::SlowLoad));
    }

    #[test]
    fn a_child_that_turns_slow_is_declined_within_a_few_requests() {
        let mut m = engine();
        loads(&mut m, 0, 0.0001, 0.002);
        assert_eq!(m.judge(0, 1024), Verdict::Take);
        // Its loads now take 3 ms per token (the store went remote, say).
        let mut turned = None;
        for k in 0..6 {
            m.loaded(0, 1024, 0.003 * 1024.0);
            if !m.judge(0, 1024).takes() {
                turned = Some(k);
                break;
            }
        }
        assert!(
            turned.is_some_and(|k| k <= 2),
            "declined after {turned:?} slow loads"
        );
    }

    #[test]
    fn a_declined_child_is_probed_and_taken_again_once_it_recovers() {
        let mut m = engine();
        loads(&mut m, 0, 0.003, 0.0); // slow
        let mut probes = 0;
        let mut taken_again_after = None;
        for req in 0..64 {
            match m.judge(0, 1024) {
                Verdict::Decline(Why::SlowLoad) => {}
                Verdict::Probe(Why::SlowLoad) => {
                    probes += 1;
                    // The probe's load is measured: the child recovered.
                    m.loaded(0, 1024, 0.0001 * 1024.0);
                }
                Verdict::Take => {
                    taken_again_after = Some(req);
                    break;
                }
                v => panic!("unexpected {v:?}"),
            }
        }
        assert!(probes >= 1, "a declined child is probed");
        let after = taken_again_after.expect("a recovered child is taken again");
        assert!(
            after <= 3 * PROBE_EVERY as usize,
            "taken again after {after} requests"
        );
        // Probes come every PROBE_EVERY-th decline, not more often.
        assert!(probes <= after / PROBE_EVERY as usize + 1);
    }

    #[test]
    fn a_not_ready_child_is_never_waited_for_longer_than_computing_takes() {
        let mut m = engine();
        // 1024 tokens compute in ~1 s.
        assert_eq!(m.judge_wait(0, 0.5, 1024), Verdict::Unmeasured);
        assert_eq!(m.judge_wait(0, 1.2, 1024), Verdict::Decline(Why::SlowWait));
        // Its waits are short: waited for.
        for _ in 0..3 {
            m.waited(0, 0.05);
        }
        assert_eq!(m.judge_wait(0, 0.0, 1024), Verdict::Take);
        assert_eq!(m.judge_wait(0, 0.3, 1024), Verdict::Take);
        // Its waits are long (2 s): not waited for at all, but probed.
        for _ in 0..6 {
            m.waited(1, 2.0);
        }
        let v: Vec<_> = (0..PROBE_EVERY)
            .map(|_| m.judge_wait(1, 0.0, 1024))
            .collect();
        assert!(v[..PROBE_EVERY as usize - 1]
            .iter()
            .all(|v| *v == Verdict::Decline(Why::SlowWait)));
        assert_eq!(v[PROBE_EVERY as usize - 1], Verdict::Probe(Why::SlowWait));
    }

    #[test]
    fn a_not_ready_child_whose_waits_end_in_nothing_is_not_waited_for_but_probed() {
        let mut m = engine();
        // Short waits (5 ms) against ~1 s of compute: waited for, as before.
        for _ in 0..3 {
            m.waited(0, 0.005);
        }
        assert_eq!(m.judge_wait(0, 0.0, 1024), Verdict::Take);
        // Those waits ended in nothing loaded from it.
        for _ in 0..3 {
            m.yielded(0, 0);
        }
        let v: Vec<_> = (0..PROBE_EVERY)
            .map(|_| m.judge_wait(0, 0.0, 1024))
            .collect();
        assert!(v[..PROBE_EVERY as usize - 1]
            .iter()
            .all(|v| *v == Verdict::Decline(Why::NoYield)));
        assert_eq!(v[PROBE_EVERY as usize - 1], Verdict::Probe(Why::NoYield));
        // A request waiting for it (the probe) keeps waiting within the bounds.
        assert_eq!(m.judge_wait(0, 0.01, 1024), Verdict::Take);
        // The probes end in tokens again: waited for within a few.
        let mut taken = None;
        for k in 0..4 * PROBE_EVERY {
            match m.judge_wait(0, 0.0, 1024) {
                Verdict::Probe(_) => m.yielded(0, 512),
                Verdict::Take => {
                    taken = Some(k);
                    break;
                }
                _ => {}
            }
        }
        assert!(taken.is_some(), "a child that serves again is waited for");
        assert!(m.learned().wait_yield[0].is_some_and(|y| y > 100.0));
        // A child whose waits end in hits is waited for throughout.
        let mut m = engine();
        for _ in 0..3 {
            m.waited(1, 0.005);
            m.yielded(1, 800);
        }
        assert!((0..32).all(|_| m.judge_wait(1, 0.0, 1024) == Verdict::Take));
    }

    #[test]
    fn compose_takes_the_prefix_of_spans_with_the_least_expected_time() {
        let mut m = engine();
        loads(&mut m, 0, 0.0001, 0.001); // host tier: fast
        loads(&mut m, 1, 0.004, 0.0); // remote tier: 4x slower than computing
        let mut out = [Verdict::Unmeasured; 2];
        assert_eq!(m.cut(&[512, 1024], &mut out), 1);
        assert_eq!(out, [Verdict::Take, Verdict::Decline(Why::SlowLoad)]);
        // A slow first span before a long fast one: both are taken when
        // that is faster overall than computing both.
        let mut m = engine();
        loads(&mut m, 0, 0.002, 0.0); // 2x slower than computing
        loads(&mut m, 1, 0.00001, 0.0); // 100x faster
        assert_eq!(m.cut(&[64, 4096], &mut out), 2);
        assert_eq!(out, [Verdict::Take, Verdict::Take]);
        // Both slow: nothing loaded.
        let mut m = engine();
        loads(&mut m, 0, 0.002, 0.0);
        loads(&mut m, 1, 0.002, 0.0);
        assert_eq!(m.cut(&[512, 512], &mut out), 0);
        assert_eq!(out, [Verdict::Decline(Why::SlowLoad); 2]);
    }
}
