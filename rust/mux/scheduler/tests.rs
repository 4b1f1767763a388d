use super::*;
use crate::mux::merge::KeyRule;
use crate::mux::notice::{Kind, Level};
use proptest::prelude::*;
use std::time::Instant;

/// Params of a test child: (key, value) pairs; an empty key stands for
/// a key that is not a string.
#[derive(Clone, Debug, PartialEq)]
struct P(Vec<(&'static str, i64)>);

#[derive(Clone, Debug, PartialEq)]
struct V(i64);

impl ValueEq for V {
    type Error = String;
    fn value_eq(&self, other: &Self) -> Result<bool, String> {
        if self.0 < 0 || other.0 < 0 {
            return Err("cannot compare".into());
        }
        Ok(self.0 == other.0)
    }
}

impl Params for P {
    type Value = V;
    type Error = String;
    fn entries(&self) -> Result<Vec<(String, V)>, ChildFault<String>> {
        self.0
            .iter()
            .map(|&(k, v)| {
                if k.is_empty() {
                    Err(ChildFault::Malformed("a key that is not a str".into()))
                } else {
                    Ok((k.to_owned(), V(v)))
                }
            })
            .collect()
    }
}

type R<T> = Result<T, ChildFault<String>>;

/// A finish hook's calls as the tests' closures ([`FinishHooks`]).
struct Fns<K, A, O, C> {
    hook: K,
    asked: A,
    own: Option<O>,
    call: C,
}

impl<K, A, O, C> FinishHooks for Fns<K, A, O, C>
where
    K: Fn(usize) -> &'static str,
    A: Fn(&str) -> bool,
    O: FnOnce(&Supplied) -> Result<P, String>,
    C: FnMut(usize) -> R<ChildFinish<P>>,
{
    type Params = P;
    fn hook(&self, i: usize) -> &'static str {
        (self.hook)(i)
    }
    fn asked(&self, key: &str) -> bool {
        (self.asked)(key)
    }
    fn own(&mut self, s: &Supplied) -> Result<P, String> {
        (self.own.take().expect("own is called at most once"))(s)
    }
    fn call(&mut self, i: usize) -> R<ChildFinish<P>> {
        (self.call)(i)
    }
}

/// [`SchedulerMux::finish`] with each of its calls a closure.
trait FinishFns {
    fn finish_fns(
        &self,
        req: &str,
        hook: impl Fn(usize) -> &'static str,
        want: Want,
        asked: impl Fn(&str) -> bool,
        own: impl FnOnce(&Supplied) -> Result<P, String>,
        call: impl FnMut(usize) -> R<ChildFinish<P>>,
    ) -> FinishResult<P>;
}

impl FinishFns for SchedulerMux {
    fn finish_fns(
        &self,
        req: &str,
        hook: impl Fn(usize) -> &'static str,
        want: Want,
        asked: impl Fn(&str) -> bool,
        own: impl FnOnce(&Supplied) -> Result<P, String>,
        call: impl FnMut(usize) -> R<ChildFinish<P>>,
    ) -> FinishResult<P> {
        let mut calls = Fns {
            hook,
            asked,
            own: Some(own),
            call,
        };
        self.finish(req, want, &mut calls)
    }
}

fn mux(n: usize, clash: ClashPolicy, load: LoadPolicy) -> SchedulerMux {
    let names = (0..n).map(|i| format!("c{i}")).collect();
    SchedulerMux::new::<String>(names, clash, load, 16).unwrap()
}

fn hit(tokens: u64) -> R<ChildMatch> {
    Ok(ChildMatch {
        tokens: Some(tokens),
        load_async: false,
    })
}

fn own(s: &Supplied) -> Result<P, String> {
    Ok(P(vec![(EXTRA_KEY, s.extra as i64)]))
}

/// Finish `req` asking for both own params; what the mux credited.
fn supplied(m: &SchedulerMux, req: &str) -> Supplied {
    let mut got = None;
    m.finish_fns(
        req,
        |_| hook::FINISHED,
        Want {
            extra: true,
            by_child: true,
        },
        |_| false,
        |s: &Supplied| {
            got = Some(s.clone());
            own(s)
        },
        |_| done(false, None),
    )
    .unwrap();
    got.unwrap()
}

fn want(extra: bool) -> Want {
    Want {
        extra,
        by_child: false,
    }
}

fn done(async_save: bool, params: Option<P>) -> R<ChildFinish<P>> {
    Ok(ChildFinish { async_save, params })
}

fn finish_with(
    m: &SchedulerMux,
    req: &str,
    want_extra: bool,
    answers: Vec<R<ChildFinish<P>>>,
) -> Result<Finished<P, V, String>, MuxError<String>> {
    let mut answers = answers.into_iter();
    m.finish_fns(
        req,
        |_| hook::FINISHED,
        want(want_extra),
        |k| k == "asked",
        own,
        |_| answers.next().unwrap(),
    )
}

fn no_tell(_: usize, _: u64) -> R<()> {
    Ok(())
}

fn no_blocks() -> Result<Vec<Vec<u32>>, String> {
    Ok(vec![])
}

#[test]
fn new_refuses_zero_or_too_many_children() {
    for n in [0, MAX_CHILDREN + 1] {
        let names = (0..n).map(|i| i.to_string()).collect();
        let err = SchedulerMux::new::<String>(names, ClashPolicy::Error, LoadPolicy::First, 16);
        assert!(matches!(err, Err(MuxError::Config(_))));
    }
}

#[test]
fn lookup_chooses_by_policy_and_counts_hits() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::Longest);
    let got = m.lookup("r", 32, |i, _| hit([0, 16, 48][i])).unwrap();
    assert_eq!((got.tokens, got.chosen), (Some(48), Some(2)));
    assert_eq!(m.chosen("r"), Some(2));
    let snap = m.snapshot();
    assert_eq!(snap.children[0][Child::Lookups as usize], 1);
    assert_eq!(snap.children[0][Child::Hits as usize], 0);
    assert_eq!(snap.children[1][Child::HitTokens as usize], 16);
}

fn with_deadlines(deadlines: Vec<Option<Duration>>) -> SchedulerMux {
    mux(deadlines.len(), ClashPolicy::Error, LoadPolicy::First)
        .with_lookup_deadlines::<String>(deadlines)
        .unwrap()
}

fn not_ready() -> R<ChildMatch> {
    Ok(ChildMatch {
        tokens: None,
        load_async: false,
    })
}

#[test]
fn a_child_past_its_deadline_is_a_miss_and_never_asked_again() {
    let m = with_deadlines(vec![Some(Duration::ZERO), None]);
    let got = m
        .lookup("r", 0, |i, _| if i == 0 { not_ready() } else { hit(32) })
        .unwrap();
    assert_eq!((got.tokens, got.chosen), (Some(32), Some(1)));
    assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 1);
    // Its late answer never counts: it is not even asked.
    let again = m
        .lookup("r", 0, |i, _| {
            assert_ne!(i, 0, "a timed-out child is not asked again");
            hit(16)
        })
        .unwrap();
    assert_eq!((again.tokens, again.chosen), (Some(16), Some(1)));
    assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 1);
    // It still took part: its finish is called like any other's.
    let mut finished = vec![];
    m.finish_fns(
        "r",
        |_| hook::FINISHED,
        want(false),
        |_| false,
        own,
        |i| {
            finished.push(i);
            done(false, None)
        },
    )
    .unwrap();
    assert_eq!(finished, [0, 1]);
}

fn with_breaker(failures: u32, cooldown_ms: u64, deadline: Option<Duration>) -> SchedulerMux {
    let cfg = BreakerConfig {
        failures,
        cooldown: Duration::from_millis(cooldown_ms),
        max_cooldown: Duration::from_millis(cooldown_ms * 8),
    };
    with_deadlines(vec![deadline, None])
        .with_breakers::<String>(vec![Some(cfg), None])
        .unwrap()
}

fn raised() -> R<ChildMatch> {
    Err(ChildFault::Raised("server gone".into()))
}

fn count(m: &SchedulerMux, i: usize, c: Child) -> u64 {
    m.snapshot().children[i][c as usize]
}

#[test]
fn a_raising_child_with_a_breaker_is_a_contained_miss_for_that_request() {
    let m = with_breaker(5, 1000, None);
    let got = m
        .lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(32) })
        .unwrap();
    assert_eq!((got.tokens, got.chosen), (Some(32), Some(1)));
    assert_eq!(got.contained.len(), 1);
    let c = &got.contained[0];
    assert_eq!((c.child, c.hook, c.first), (0, hook::LOOKUP, true));
    assert_eq!(count(&m, 0, Child::LookupErrors), 1);
    // Not asked again for this request.
    m.lookup("r", 0, |i, _| {
        assert_ne!(i, 0);
        hit(32)
    })
    .unwrap();
    // The next failure is logged quietly.
    let next = m
        .lookup("s", 0, |i, _| if i == 0 { raised() } else { hit(0) })
        .unwrap();
    assert!(!next.contained[0].first);
    // Without a breaker, a raising child fails the call (see
    // lookup_fault_names_the_child_and_drops_state).
    assert!(m.forget("r") && m.forget("s"));
    assert!(!m.table.any_excluded(), "finishing clears the exclusions");
}

#[test]
fn an_interrupt_is_never_contained() {
    // With a breaker a raising lookup is a contained miss; an interrupt
    // (Ctrl-C in a child) is handed back, and the request forgotten.
    let m = with_breaker(3, 1000, None);
    let err = m
        .lookup("r", 0, |i, _| {
            if i == 0 {
                Err(ChildFault::Interrupt("KeyboardInterrupt".into()))
            } else {
                hit(0)
            }
        })
        .unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            fault: ChildFault::Interrupt(_),
            ..
        }
    ));
    assert_eq!(m.live_requests(), 0);
    assert_eq!(count(&m, 0, Child::LookupErrors), 0);
    // On the way out, a child that never took part fails the call when
    // interrupted (a raise would be contained), after every child ran.
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let answers = vec![
        Err(ChildFault::Interrupt("SystemExit".into())),
        done(true, None),
    ];
    let err = finish_with(&m, "x", false, answers).unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            child: 0,
            fault: ChildFault::Interrupt(_),
            ..
        }
    ));
    assert_eq!(m.live_requests(), 0);
}

#[test]
fn huge_composed_counts_saturate_instead_of_wrapping() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::Compose);
    let big = i64::MAX as u64;
    let got = m.lookup("r", 0, |i, _| hit([big, big, 5][i])).unwrap();
    assert_eq!(got.tokens, Some(u64::MAX));
}

#[test]
fn consecutive_failures_open_the_breaker_and_skip_the_child() {
    let m = with_breaker(2, 30, Some(Duration::ZERO));
    // A request that waits on child 0 with a deadline not yet passed.
    for r in ["a", "b"] {
        m.lookup(r, 0, |i, _| if i == 0 { not_ready() } else { hit(0) })
            .unwrap();
    }
    assert_eq!(m.breaker(0), Some(State::Open));
    assert_eq!(m.breaker(1), None);
    assert_eq!(count(&m, 0, Child::BreakerOpens), 1);
    let t = m.take_breaker_transitions();
    assert_eq!(t.len(), 1);
    assert_eq!((t[0].child, t[0].to, t[0].failures), (0, State::Open, 2));
    assert_eq!(
        m.take_breaker_changes(),
        Some(vec![Some(State::Open), None])
    );
    // While open, a new request is not held by it: it is told of the
    // request once (a child may keep per-request state from its
    // lookup), its answer ignored, and not asked again.
    let mut asked = vec![];
    let got = m
        .lookup("c", 0, |i, _| {
            asked.push(i);
            if i == 0 {
                not_ready()
            } else {
                hit(16)
            }
        })
        .unwrap();
    assert_eq!((got.tokens, got.chosen), (Some(16), Some(1)));
    assert_eq!(count(&m, 0, Child::BreakerSkips), 1);
    m.lookup("c", 0, |i, _| {
        asked.push(i);
        hit(16)
    })
    .unwrap();
    assert_eq!(asked, [0, 1, 1], "told once, then not asked");
    // It takes part: it gets the allocation (0 tokens) and the finish.
    let mut told = vec![];
    m.allocated("c", 16, no_blocks, |i, n| {
        told.push((i, n));
        Ok(())
    })
    .unwrap();
    assert_eq!(told, [(0, 0), (1, 16)]);
    let mut finished = vec![];
    m.finish_fns(
        "c",
        |_| hook::FINISHED,
        want(false),
        |_| false,
        own,
        |i| {
            finished.push(i);
            done(false, None)
        },
    )
    .unwrap();
    assert_eq!(finished, [0, 1]);
    // A request that asked it before it opened still tells it.
    let mut told = vec![];
    m.allocated("a", 0, no_blocks, |i, n| {
        told.push((i, n));
        Ok(())
    })
    .unwrap();
    assert_eq!(told, [(0, 0), (1, 0)]);
    // After the cooldown one request probes it; its answer closes it.
    std::thread::sleep(Duration::from_millis(40));
    let mut asked = vec![];
    m.lookup("probe", 0, |i, _| {
        asked.push(i);
        hit(0)
    })
    .unwrap();
    assert_eq!(asked, [0, 1]);
    assert_eq!(m.breaker(0), Some(State::Closed));
    let to: Vec<State> = m.take_breaker_transitions().iter().map(|t| t.to).collect();
    assert_eq!(to, [State::HalfOpen, State::Closed]);
    for r in ["a", "b", "probe"] {
        assert!(m.forget(r));
    }
    assert_eq!(m.live_requests(), 0);
}

#[test]
fn a_failed_probe_reopens_and_a_finished_probe_hands_it_on() {
    let m = with_breaker(1, 10, None);
    m.lookup("a", 0, |i, _| if i == 0 { raised() } else { hit(0) })
        .unwrap();
    assert_eq!(m.breaker(0), Some(State::Open));
    std::thread::sleep(Duration::from_millis(15));
    // The probe is not ready yet; another request skips the child.
    m.lookup("p", 0, |i, _| if i == 0 { not_ready() } else { hit(0) })
        .unwrap();
    assert_eq!(m.breaker(0), Some(State::HalfOpen));
    // Another request tells it once, but its answer does not count.
    m.lookup("q", 0, |i, _| hit(if i == 0 { 64 } else { 0 }))
        .unwrap();
    assert_eq!(
        m.breaker(0),
        Some(State::HalfOpen),
        "only the probe's answer counts"
    );
    // The probe ends unanswered: the next request probes.
    finish_with(&m, "p", false, vec![done(false, None), done(false, None)]).unwrap();
    m.lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(0) })
        .unwrap();
    assert_eq!(m.breaker(0), Some(State::Open));
    let opened: Vec<u128> = m
        .take_breaker_transitions()
        .iter()
        .filter_map(|t| t.cooldown)
        .map(|d| d.as_millis())
        .collect();
    assert_eq!(opened, [10, 20], "a failed probe doubles the cooldown");
    for r in ["a", "q", "r"] {
        assert!(m.forget(r));
    }
    assert!(!m.table.any_excluded());
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
        let got =
            mux(1, ClashPolicy::Error, LoadPolicy::First).with_breakers::<String>(vec![Some(cfg)]);
        assert!(matches!(got, Err(MuxError::Config(_))));
    }
}

#[test]
fn within_its_deadline_a_not_ready_child_keeps_the_request_waiting() {
    let hour = Some(Duration::from_secs(3600));
    let m = with_deadlines(vec![hour, None]);
    let got = m
        .lookup("r", 0, |i, _| if i == 0 { not_ready() } else { hit(32) })
        .unwrap();
    assert_eq!(got.tokens, None);
    assert_eq!(m.snapshot().children[0][Child::LookupTimeouts as usize], 0);
    // A child without a deadline waits for ever, whatever the others'.
    let m = with_deadlines(vec![None, Some(Duration::ZERO)]);
    let got = m.lookup("r", 0, |_, _| not_ready()).unwrap();
    assert_eq!(got.tokens, None);
    assert_eq!(m.snapshot().children[1][Child::LookupTimeouts as usize], 1);
}

#[test]
fn the_deadline_runs_from_the_first_lookup() {
    let m = with_deadlines(vec![Some(Duration::from_millis(30))]);
    assert_eq!(m.lookup("r", 0, |_, _| not_ready()).unwrap().tokens, None);
    std::thread::sleep(Duration::from_millis(40));
    assert_eq!(
        m.lookup("r", 0, |_, _| not_ready()).unwrap().tokens,
        Some(0)
    );
}

#[test]
fn deadlines_are_one_per_child() {
    let err =
        mux(2, ClashPolicy::Error, LoadPolicy::First).with_lookup_deadlines::<String>(vec![None]);
    assert!(matches!(err, Err(MuxError::Config(_))));
}

#[test]
fn lookup_over_many_children_chooses_among_all() {
    let m = mux(MAX_CHILDREN, ClashPolicy::Error, LoadPolicy::Longest);
    let got = m
        .lookup("r", 0, |i, _| {
            hit(if i == MAX_CHILDREN - 1 { 64 } else { 16 })
        })
        .unwrap();
    assert_eq!((got.tokens, got.chosen), (Some(64), Some(MAX_CHILDREN - 1)));
}

#[test]
fn not_ready_lookup_counts_nothing_and_keeps_the_choice() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(16)).unwrap();
    let got = m
        .lookup("r", 0, |i, _| -> R<ChildMatch> {
            Ok(ChildMatch {
                tokens: (i == 0).then_some(16),
                load_async: false,
            })
        })
        .unwrap();
    assert_eq!(got.tokens, None);
    assert_eq!(m.chosen("r"), Some(0));
    assert_eq!(m.snapshot().children[0][Child::Lookups as usize], 1);
}

#[test]
fn lookup_fault_names_the_child_and_drops_state() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(16)).unwrap();
    let err = m
        .lookup("r", 0, |i, _| {
            if i == 1 {
                Err(ChildFault::Raised("boom".to_owned()))
            } else {
                hit(0)
            }
        })
        .unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            child: 1,
            hook: hook::LOOKUP,
            ..
        }
    ));
    assert_eq!(m.live_requests(), 0);
}

#[test]
fn load_async_with_zero_tokens_is_malformed() {
    let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
    let err = m
        .lookup("r", 0, |_, _| -> R<ChildMatch> {
            Ok(ChildMatch {
                tokens: Some(0),
                load_async: true,
            })
        })
        .unwrap_err();
    match err {
        MuxError::Child {
            fault: ChildFault::Malformed(why),
            ..
        } => assert!(why.contains("load_async=True with 0 tokens")),
        other => panic!("{other:?}"),
    }
}

#[test]
fn allocation_tells_the_chosen_child_only_and_watches_its_load() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |i, _| hit([0, 32, 64][i])).unwrap();
    let mut told = vec![];
    let chosen = m
        .allocated(
            "r",
            32,
            || Ok::<_, String>(vec![vec![7, 8]]),
            |i, n| {
                told.push((i, n));
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(chosen, Some(1));
    assert_eq!(told, [(0, 0), (1, 32), (2, 0)]);
    assert!(m.watching());
    let s = m.snapshot();
    assert_eq!(s.children[1][Child::Loads as usize], 1);
    assert_eq!(s.children[1][Child::LoadTokens as usize], 32);
    // The second call vLLM makes after an async load tells everyone 0.
    told.clear();
    let again = m
        .allocated("r", 0, no_blocks, |i, n| {
            told.push((i, n));
            Ok(())
        })
        .unwrap();
    assert_eq!(again, None);
    assert_eq!(told, [(0, 0), (1, 0), (2, 0)]);
}

#[test]
fn a_load_is_watched_for_block_errors_only_on_a_single_group_model() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(16)).unwrap();
    let two_groups = || -> Result<Vec<Vec<u32>>, String> { Ok(vec![vec![1], vec![2]]) };
    m.allocated("r", 16, two_groups, no_tell).unwrap();
    assert_eq!(
        m.load_errors(|b| b == 1, |_| false),
        0,
        "several groups: no block-level errors, vLLM fails whole requests"
    );
    assert_eq!(m.load_errors(|_| false, |r| r == "r"), 1);
    m.lookup("s", 0, |_, _| hit(16)).unwrap();
    let one_group = || -> Result<Vec<Vec<u32>>, String> { Ok(vec![vec![3]]) };
    m.allocated("s", 16, one_group, no_tell).unwrap();
    assert_eq!(m.load_errors(|b| b == 3, |_| false), 1);
}

#[test]
fn allocation_fault_drops_state_and_watch() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(16)).unwrap();
    let err = m
        .allocated(
            "r",
            16,
            || Ok(vec![vec![1]]),
            |i, _| {
                if i == 1 {
                    Err(ChildFault::Raised("no".to_owned()))
                } else {
                    Ok(())
                }
            },
        )
        .unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            child: 1,
            hook: hook::ALLOC,
            ..
        }
    ));
    assert_eq!(m.live_requests(), 0);
    assert!(!m.watching());
}

#[test]
fn finish_reports_loaded_tokens_when_asked_and_passes_one_source_uncopied() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 16, |i, _| hit([0, 32][i])).unwrap();
    m.allocated("r", 32, no_blocks, no_tell).unwrap();
    let f = finish_with(&m, "r", true, vec![done(false, None), done(false, None)]).unwrap();
    assert_eq!(
        f.params,
        Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 32)])))
    );
    assert_eq!(m.live_requests(), 0);
    let one = P(vec![("remote", 1)]);
    let f = finish_with(
        &m,
        "s",
        false,
        vec![done(false, Some(one.clone())), done(false, None)],
    )
    .unwrap();
    assert_eq!(f.params, Some(FinishedParams::Source(one)));
    let f = finish_with(&m, "t", false, vec![done(false, None), done(false, None)]).unwrap();
    assert_eq!(f.params, None);
    assert_eq!(m.snapshot().totals[Total::Finished as usize], 3);
    assert_eq!(m.snapshot().totals[Total::ExtraCachedTokens as usize], 32);
}

#[test]
fn several_async_savers_make_the_workers_wait_for_the_rest() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(0)).unwrap();
    let f = finish_with(
        &m,
        "r",
        false,
        vec![done(true, None), done(true, None), done(true, None)],
    )
    .unwrap();
    assert!(f.async_save);
    let out = m.take_outbox();
    assert_eq!(out.saves.get("r"), Some(&(0b111, 3)), "every saver reports");
    assert!(m.take_outbox().is_empty(), "taken once");
    assert_eq!(m.snapshot().totals[Total::ExtraAsyncSaves as usize], 2);
    assert_eq!(m.snapshot().children[2][Child::AsyncSaves as usize], 1);
}

/// A lookup where child 0 loads `tokens` asynchronously, and the
/// allocation of its load.
fn async_load(m: &SchedulerMux, req: &str, tokens: u64) {
    m.lookup(req, 0, |i, _| {
        R::Ok(ChildMatch {
            tokens: Some(if i == 0 { tokens } else { 0 }),
            load_async: i == 0,
        })
    })
    .unwrap();
    m.allocated(req, tokens, no_blocks, no_tell).unwrap();
}

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

#[test]
fn a_resumed_request_credits_each_token_once_to_its_first_source() {
    // Child 1 loads 48 tokens; preempted, the request is looked up again
    // and vLLM's cache holds those 48 and 16 it computed: the child
    // keeps its 48, vLLM's cache gets the 16 after them.
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |i, _| hit([0, 48][i])).unwrap();
    m.allocated("r", 48, no_blocks, no_tell).unwrap();
    m.lookup("r", 64, |_, _| hit(0)).unwrap();
    m.lookup("r", 64, |_, _| hit(0)).unwrap(); // a repeat: the same admission
    m.allocated("r", 0, no_blocks, no_tell).unwrap();
    let s = supplied(&m, "r");
    assert_eq!(
        (s.extra, s.by_child.to_vec(), s.local),
        (48, vec![0, 48], 16)
    );
    let snap = m.snapshot();
    assert_eq!(snap.children[1][Child::ServedTokens as usize], 48);
    assert_eq!(snap.totals[Total::LocalCachedTokens as usize], 16);
    // Resumed with a reload past the old span: only the new tokens count.
    m.lookup("s", 0, |i, _| hit([0, 48][i])).unwrap();
    m.allocated("s", 48, no_blocks, no_tell).unwrap();
    m.lookup("s", 32, |i, _| hit([32, 0][i])).unwrap();
    m.allocated("s", 32, no_blocks, no_tell).unwrap();
    let s = supplied(&m, "s");
    assert_eq!(
        (s.extra, s.by_child.to_vec(), s.local),
        (64, vec![16, 48], 0)
    );
    // Preempted, then aborted before it was admitted again: the first
    // admission stands.
    m.lookup("t", 0, |i, _| hit([0, 48][i])).unwrap();
    m.allocated("t", 48, no_blocks, no_tell).unwrap();
    m.lookup("t", 48, |_, _| hit(0)).unwrap();
    let s = supplied(&m, "t");
    assert_eq!(
        (s.extra, s.by_child.to_vec(), s.local),
        (48, vec![0, 48], 0)
    );
    // Its credits lived in its one entry: none are left behind.
    assert_eq!(m.live_requests(), 0, "no credits left behind");
}

#[test]
fn an_async_loads_second_allocation_is_the_same_admission() {
    let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
    async_load(&m, "r", 48);
    m.allocated("r", 0, no_blocks, no_tell).unwrap();
    let s = supplied(&m, "r");
    assert_eq!((s.extra, s.local), (48, 0));
}

proptest! {
    /// Any admissions (local hit, then a span), in any order: the
    /// credits add up to at most the furthest token reached, and never
    /// shrink.
    #[test]
    fn credits_count_each_token_once(adm in proptest::collection::vec((0u64..8, 0u64..8, 0usize..2), 1..6)) {
        let mut c = Credits::default();
        let mut reach = 0;
        for (local, span, child) in adm {
            let (local, span) = (local * 16, span * 16);
            let mut split = [0u64; 2];
            split[child] = span;
            let before = c.clone();
            c.add(local, &split);
            reach = reach.max(local + span);
            prop_assert_eq!(c.covered, reach);
            prop_assert_eq!(c.local + c.by_child.iter().sum::<u64>(), reach);
            prop_assert!(c.local >= before.local);
        }
    }
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
    let blocks = || -> Result<Vec<Vec<u32>>, String> { Ok(vec![vec![7, 8, 9, 10, 11]]) };
    m.allocated("r", 40, blocks, no_tell).unwrap();
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
    m.allocated(
        "r",
        16,
        || -> Result<Vec<Vec<u32>>, String> { Ok(vec![vec![1]]) },
        no_tell,
    )
    .unwrap();
    assert!(m.take_outbox().load_blocks.is_empty());
}

#[test]
fn untracked_request_never_waits_for_extra_saves() {
    // A request never looked up (aborted while waiting) or finished twice:
    // the first saver's completion ends it.
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let f = finish_with(&m, "x", false, vec![done(true, None), done(true, None)]).unwrap();
    assert!(f.async_save);
    assert_eq!(m.take_outbox().saves.get("x"), Some(&(0b11, 1)));
}

#[test]
fn an_async_load_is_announced_with_its_child() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let lazy = |i: usize| -> R<ChildMatch> {
        Ok(ChildMatch {
            tokens: Some(if i == 1 { 32 } else { 0 }),
            load_async: i == 1,
        })
    };
    m.lookup("r", 0, |i, _| lazy(i)).unwrap();
    m.allocated("r", 32, no_blocks, no_tell).unwrap();
    assert_eq!(m.take_outbox().loads.get("r"), Some(&0b10));
    // vLLM's second call once the load is done announces nothing.
    m.allocated("r", 0, no_blocks, no_tell).unwrap();
    assert!(m.take_outbox().is_empty());
    // A synchronous load is not waited for.
    m.lookup("s", 0, |i, _| hit([0, 16][i])).unwrap();
    m.allocated("s", 16, no_blocks, no_tell).unwrap();
    assert!(m.take_outbox().is_empty());
}

#[test]
fn failure_of_a_child_that_never_took_part_is_contained() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let f = finish_with(
        &m,
        "x",
        true,
        vec![Err(ChildFault::Raised("tracker".into())), done(true, None)],
    )
    .unwrap();
    assert!(f.async_save);
    assert_eq!(f.contained.len(), 1);
    assert!(f.contained[0].first && f.contained[0].child == 0);
    assert_eq!(
        f.params,
        Some(FinishedParams::Source(P(vec![(EXTRA_KEY, 0)])))
    );
    // The contained child is not among the savers: its completion of
    // the request will be a stray, dropped.
    assert_eq!(m.take_outbox().saves.get("x"), Some(&(0b10, 1)));
    let again = finish_with(
        &m,
        "y",
        false,
        vec![Err(ChildFault::Raised("tracker".into())), done(false, None)],
    )
    .unwrap();
    assert!(!again.contained[0].first, "loud once per child");
    assert_eq!(m.snapshot().children[0][Child::ContainedErrors as usize], 2);
}

#[test]
fn failure_of_a_child_that_took_part_raises_after_calling_everyone() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::First);
    m.lookup("r", 0, |_, _| hit(0)).unwrap();
    let mut called = vec![];
    let err = m
        .finish_fns(
            "r",
            |_| hook::FINISHED_ALL_GROUPS,
            want(false),
            |_| false,
            own,
            |i| {
                called.push(i);
                if i == 0 {
                    Err(ChildFault::Raised("x".to_owned()))
                } else {
                    done(false, None)
                }
            },
        )
        .unwrap_err();
    assert_eq!(called, [0, 1, 2]);
    assert!(matches!(
        err,
        MuxError::Child {
            child: 0,
            hook: hook::FINISHED_ALL_GROUPS,
            ..
        }
    ));
    assert_eq!(m.live_requests(), 0);
    assert!(m.take_outbox().is_empty());
}

#[test]
fn clash_policies_on_finish() {
    let a = || done(false, Some(P(vec![("k", 1), ("a", 5)])));
    let b = || done(false, Some(P(vec![("k", 2)])));
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let err = finish_with(&m, "r", false, vec![a(), b()]).unwrap_err();
    assert!(
        matches!(err, MuxError::ParamClash { ref key, first: 0, second: 1, policy: "error" } if key == "k")
    );
    assert_eq!(m.snapshot().totals[Total::ClashesRaised as usize], 1);

    let m = mux(2, ClashPolicy::Last, LoadPolicy::First);
    let f = finish_with(&m, "r", false, vec![a(), b()]).unwrap();
    let Some(FinishedParams::Merged(merged)) = &f.params else {
        panic!("merged params expected");
    };
    let kv: Vec<_> = merged.iter().map(|e| (e.key.as_str(), &e.value)).collect();
    assert_eq!(kv, [("k", &V(2)), ("a", &V(5))]);
    assert_eq!(f.new_clashes.len(), 1);
    let f = finish_with(&m, "s", false, vec![a(), b()]).unwrap();
    assert!(f.new_clashes.is_empty(), "warned once per key");
    assert_eq!(m.snapshot().totals[Total::ClashesResolved as usize], 2);
}

#[test]
fn a_multi_group_finish_with_a_child_without_hma_is_refused_and_forgotten() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First)
        .with_hma::<String>(vec![true, false], "turn HMA off".into())
        .unwrap();
    m.lookup("r", 0, |_, _| hit(16)).unwrap();
    assert_eq!(m.live_requests(), 1);
    let refused = m.finish_route(2).unwrap_err();
    let err = m.refuse::<String>("r", refused);
    let MuxError::TooManyGroups {
        ref request,
        groups,
        ref children,
    } = err
    else {
        panic!("refusal expected, got {err:?}");
    };
    assert_eq!(
        (request.as_str(), groups, children.as_slice()),
        ("r", 2, &[1][..])
    );
    assert_eq!(
        m.live_requests(),
        0,
        "the refused request's state is dropped"
    );
    assert!(m.refusal("r", 2, &[1]).contains("children ['c1']"));
    assert!(m.refusal("r", 2, &[1]).contains("turn HMA off"));
    // One group: the child without HMA gets request_finished.
    let route = m.finish_route(1).unwrap();
    assert_eq!(
        (route.hook(0), route.hook(1)),
        (hook::FINISHED_ALL_GROUPS, hook::FINISHED)
    );
    assert!(mux(2, ClashPolicy::Error, LoadPolicy::First)
        .with_hma::<String>(vec![true], String::new())
        .is_err());
}

#[test]
fn notices_tell_each_contained_failure_clash_and_breaker_transition_once() {
    // A breaker opens on the first raising lookup: the lookup's notices
    // are the contained miss (loud, the child's first) and the opening.
    let m = with_breaker(1, 60_000, None);
    let got = m
        .lookup("r", 0, |i, _| if i == 0 { raised() } else { hit(0) })
        .unwrap();
    let notices = m.lookup_notices("r", &got.contained);
    let kinds: Vec<_> = notices.iter().map(|n| (n.kind, n.level)).collect();
    assert_eq!(
        kinds,
        [
            (Kind::LookupMiss, Level::Warning),
            (Kind::BreakerOpened, Level::Warning)
        ]
    );
    assert!(notices[0].text.contains("contained as a miss"));
    assert!(notices[1].text.contains("breaker of child 'c0' opened"));
    assert!(
        m.lookup_notices::<String>("s", &[]).is_empty(),
        "a transition is told once"
    );
    // A clash resolved by the policy, told once per key.
    let m = mux(2, ClashPolicy::First, LoadPolicy::First);
    let a = || done(false, Some(P(vec![("k", 1)])));
    let f = finish_with(&m, "r", false, vec![a(), a()]).unwrap();
    let notices = m.exit_notices("r", &f.contained, &f.new_clashes);
    assert_eq!(notices.len(), 1);
    assert!(notices[0]
        .text
        .contains("'c0' and 'c1' both return kv_transfer_params key 'k'"));
    let f = finish_with(&m, "s", false, vec![a(), a()]).unwrap();
    assert!(m.exit_notices("s", &f.contained, &f.new_clashes).is_empty());
}

#[test]
fn each_child_and_the_local_cache_are_credited_their_tokens() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::Longest);
    m.lookup("r", 16, |i, _| hit([0, 48, 32][i])).unwrap();
    m.allocated("r", 48, no_blocks, no_tell).unwrap();
    let s = supplied(&m, "r");
    assert_eq!((s.extra, s.local), (48, 16));
    assert_eq!(s.by_child[..], [0, 48, 0]);
    assert_eq!(s.by_child.iter().sum::<u64>(), s.extra);
    let snap = m.snapshot();
    assert_eq!(snap.children[1][Child::ServedTokens as usize], 48);
    assert_eq!(snap.children[2][Child::ServedTokens as usize], 0);
    assert_eq!(snap.totals[Total::LocalCachedTokens as usize], 16);
    // Counted whether or not the request asked.
    m.lookup("s", 0, |i, _| hit([0, 0, 32][i])).unwrap();
    m.allocated("s", 32, no_blocks, no_tell).unwrap();
    finish_with(&m, "s", false, (0..3).map(|_| done(false, None)).collect()).unwrap();
    assert_eq!(m.snapshot().children[2][Child::ServedTokens as usize], 32);
}

#[test]
fn compose_asks_each_child_after_the_earlier_ones_and_splits_the_load() {
    let m = mux(3, ClashPolicy::Error, LoadPolicy::Compose);
    // Child 0 holds [16, 48), child 1 up to 80 (asked from 48), child 2 nothing.
    let mut asked = vec![];
    let got = m
        .lookup("r", 16, |i, nct| -> R<ChildMatch> {
            asked.push((i, nct));
            let held = [48, 80, 0][i];
            Ok(ChildMatch {
                tokens: Some(held.max(nct) - nct),
                load_async: i == 1,
            })
        })
        .unwrap();
    assert_eq!(asked, [(0, 16), (1, 48), (2, 80)]);
    assert_eq!(
        (got.tokens, got.chosen, got.load_async),
        (Some(64), Some(0), true)
    );
    let mut told = vec![];
    m.allocated("r", 64, no_blocks, |i, n| {
        told.push((i, n));
        Ok(())
    })
    .unwrap();
    assert_eq!(told, [(0, 32), (1, 32), (2, 0)]);
    assert_eq!(
        m.take_outbox().loads.get("r"),
        Some(&0b10),
        "child 1 loads async"
    );
    let s = supplied(&m, "r");
    assert_eq!(
        (s.by_child.to_vec(), s.extra, s.local),
        (vec![32, 32, 0], 64, 16)
    );
    assert_eq!(m.live_requests(), 0);
    assert!(
        m.table.with("r", |_| ()).is_none(),
        "its spans left with it"
    );
}

#[test]
fn compose_cuts_spans_from_the_end_when_vllm_allocates_less_or_a_load_fails() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::Compose);
    m.lookup("r", 0, |i, _| hit([32, 32][i])).unwrap();
    let mut told = vec![];
    m.allocated(
        "r",
        48,
        || Ok::<_, String>(vec![vec![1, 2, 3, 4]]),
        |i, n| {
            told.push((i, n));
            Ok(())
        },
    )
    .unwrap();
    assert_eq!(told, [(0, 32), (1, 16)]);
    // Block 2 (tokens 32..48, child 1's span) fails: vLLM recomputes it.
    assert_eq!(m.load_errors(|b| b == 3, |_| false), 1);
    assert_eq!(supplied(&m, "r").by_child[..], [32, 0]);
}

#[test]
fn first_and_longest_ask_every_child_from_vllms_computed_tokens() {
    for policy in [LoadPolicy::First, LoadPolicy::Longest] {
        let m = mux(2, ClashPolicy::Error, policy);
        let mut asked = vec![];
        m.lookup("r", 16, |i, nct| {
            asked.push((i, nct));
            hit(32)
        })
        .unwrap();
        assert_eq!(asked, [(0, 16), (1, 16)], "{policy:?}");
    }
}

#[test]
fn compose_waits_for_a_child_before_asking_the_ones_after_it() {
    let m = with_deadlines(vec![None, None]);
    let m = SchedulerMux {
        load: LoadPolicy::Compose,
        ..m
    };
    let got = m
        .lookup("r", 0, |i, _| {
            assert_eq!(i, 0, "child 1 is asked once child 0 answered");
            not_ready()
        })
        .unwrap();
    assert_eq!(got.tokens, None);
    let mut asked = vec![];
    let got = m
        .lookup("r", 0, |i, nct| {
            asked.push((i, nct));
            hit(16)
        })
        .unwrap();
    assert_eq!(asked, [(0, 0), (1, 16)]);
    assert_eq!(got.tokens, Some(32));
}

#[test]
fn own_keys_win_over_a_childs_under_every_policy() {
    // A nested kvmux answers num_extra_cached_tokens too: the outer
    // multiplexer's count is the request's, never an error.
    for policy in [ClashPolicy::Error, ClashPolicy::Strict, ClashPolicy::First] {
        let m = mux(1, policy, LoadPolicy::First);
        let child = done(false, Some(P(vec![(EXTRA_KEY, 9), ("a", 1)])));
        let f = finish_with(&m, "r", true, vec![child]).unwrap();
        let Some(FinishedParams::Merged(merged)) = &f.params else {
            panic!("merged params expected");
        };
        let extra = merged.iter().find(|e| e.key == EXTRA_KEY).unwrap();
        assert_eq!((&extra.value, extra.source), (&V(0), 1));
        assert_eq!(f.new_clashes[0].rule, KeyRule::Own(1));
        assert_eq!(m.snapshot().totals[Total::ClashesRaised as usize], 0);
    }
    assert_eq!(
        mux(1, ClashPolicy::Error, LoadPolicy::First).name(1),
        "kvmux"
    );
}

#[test]
fn a_clash_on_a_key_the_request_asked_for_is_answered_per_child_not_raised() {
    for policy in [ClashPolicy::Error, ClashPolicy::Strict] {
        let m = mux(2, policy, LoadPolicy::First);
        let a = done(false, Some(P(vec![("asked", 1)])));
        let b = done(false, Some(P(vec![("asked", 2)])));
        let f = finish_with(&m, "r", false, vec![a, b]).unwrap();
        let Some(FinishedParams::Merged(merged)) = &f.params else {
            panic!("merged params expected");
        };
        assert_eq!(merged.len(), 1);
        assert_eq!((&merged[0].value, merged[0].source), (&V(1), 0));
        assert_eq!(merged[0].others, vec![(1, V(2))]);
        assert_eq!(f.new_clashes.len(), 1, "logged once per key");
        let totals = m.snapshot().totals;
        assert_eq!(totals[Total::ClashesResolved as usize], 1);
        assert_eq!(totals[Total::ClashesRaised as usize], 0);
        assert_eq!(m.live_requests(), 0);
        // A key the request did not ask for still follows the policy.
        let a = done(false, Some(P(vec![("k", 1)])));
        let b = done(false, Some(P(vec![("k", 2)])));
        assert!(finish_with(&m, "s", false, vec![a, b]).is_err());
    }
}

#[test]
fn malformed_params_name_the_child_and_failed_compare_is_the_hosts() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let bad = done(false, Some(P(vec![("", 1)])));
    let err = finish_with(&m, "r", false, vec![done(false, Some(P(vec![]))), bad]).unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            child: 1,
            fault: ChildFault::Malformed(_),
            ..
        }
    ));
    let neg = || done(false, Some(P(vec![("k", -1)])));
    let err = finish_with(&m, "s", false, vec![neg(), neg()]).unwrap_err();
    assert!(matches!(err, MuxError::Host(_)));
}

#[test]
fn partial_tail_is_any_and_contains_like_finish() {
    let m = mux(2, ClashPolicy::Error, LoadPolicy::First);
    let (keep, contained) = m
        .partial_tail("x", |i| {
            if i == 0 {
                Err(ChildFault::Raised("x".to_owned()))
            } else {
                Ok(true)
            }
        })
        .unwrap();
    assert!(keep);
    assert_eq!(contained.len(), 1);
    m.lookup("r", 0, |_, _| hit(0)).unwrap();
    let err = m
        .partial_tail("r", |_| Err(ChildFault::Raised("y".to_owned())))
        .unwrap_err();
    assert!(matches!(
        err,
        MuxError::Child {
            child: 0,
            hook: hook::PARTIAL_TAIL,
            ..
        }
    ));
}

#[test]
fn load_errors_take_back_tokens_from_the_first_bad_block() {
    let m = mux(1, ClashPolicy::Error, LoadPolicy::First);
    // 16 local tokens (block 0), 48 loaded into blocks 1..=3.
    m.lookup("r", 16, |_, _| hit(48)).unwrap();
    m.allocated(
        "r",
        48,
        || Ok::<_, String>(vec![vec![10, 11, 12, 13]]),
        no_tell,
    )
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
    m.allocated("r", 32, || Ok::<_, String>(vec![vec![1, 2]]), no_tell)
        .unwrap();
    finish_with(&m, "r", false, vec![done(false, None)]).unwrap();
    assert!(!m.watching());
    m.lookup("s", 0, |_, _| hit(32)).unwrap();
    m.allocated("s", 32, || Ok::<_, String>(vec![vec![1, 2]]), no_tell)
        .unwrap();
    m.forget("s");
    assert!(!m.watching());
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

proptest! {
    /// Whatever the children answer, a finished request leaves no state
    /// and the workers wait for exactly (savers - 1) extra completions.
    #[test]
    fn finish_always_cleans_up(savers in proptest::collection::vec(any::<bool>(), 1..8),
                               looked_up in any::<bool>(),
                               fail in proptest::option::of(0usize..8)) {
        let n = savers.len();
        let m = mux(n, ClashPolicy::Error, LoadPolicy::First);
        if looked_up {
            m.lookup("r", 0, |_, _| hit(0)).unwrap();
        }
        let res = m.finish_fns("r", |_| hook::FINISHED, want(false), |_| false, own, |i| {
            if Some(i) == fail { Err(ChildFault::Raised("x".to_owned())) }
            else { done(savers[i], None) }
        });
        prop_assert_eq!(m.live_requests(), 0);
        let out = m.take_outbox();
        let failed = fail.filter(|&f| f < n);
        match (res, failed) {
            (Err(_), Some(_)) => prop_assert!(looked_up && out.is_empty()),
            (Ok(f), _) => {
                let k = savers.iter().enumerate()
                    .filter(|&(i, &s)| s && Some(i) != failed).count() as u32;
                prop_assert_eq!(f.async_save, k > 0);
                let savers: u64 = savers.iter().enumerate()
                    .filter(|&(i, &s)| s && Some(i) != failed)
                    .map(|(i, _)| 1u64 << i).sum();
                let need = if looked_up { k } else { k.min(1) };
                let want = (k > 0).then_some((savers, need));
                prop_assert_eq!(out.saves.get("r").copied(), want);
            }
            (Err(e), None) => prop_assert!(false, "unexpected {:?}", e),
        }
    }
}
