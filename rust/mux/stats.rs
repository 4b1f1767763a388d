//! Counters of the multiplexer, kept with relaxed atomics so that any thread
//! may bump them without a lock. `snapshot` reads them all (cumulative);
//! `take_interval` returns what changed since the previous take, for vLLM's
//! per-interval connector stats.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Per-child counters, by index into `CHILD_NAMES`.
#[derive(Clone, Copy, Debug)]
pub enum Child {
    /// Lookups answered with a count (not "not ready").
    Lookups,
    /// Lookups that reported more than 0 matched tokens.
    Hits,
    /// Matched tokens reported, summed over hit lookups.
    HitTokens,
    /// Requests this child was chosen to load.
    Loads,
    /// External tokens allocated for this child to load.
    LoadTokens,
    /// Async saves this child started on finished requests.
    AsyncSaves,
    /// Failures of this child on requests it never took part in, contained.
    ContainedErrors,
    /// Lookups this child left "not ready" past its deadline (a miss).
    LookupTimeouts,
    /// Lookups this child raised on, contained as a miss (it has a breaker).
    LookupErrors,
    /// Times this child's breaker opened.
    BreakerOpens,
    /// Requests whose lookup skipped this child because its breaker was open.
    BreakerSkips,
    /// Tokens this child supplied to finished requests (failed loads not
    /// counted): its share of `num_extra_cached_tokens`.
    ServedTokens,
    /// Worker: async saves this child reported finished (once per request).
    SaveCompletions,
    /// Worker: async loads this child reported finished or failed.
    LoadCompletions,
    /// Worker: completions this child reported for a request it owed none
    /// for (a duplicate, or one it never saved or loaded): dropped.
    StrayCompletions,
    /// Worker: async loads this child left unfinished past its deadline
    /// (failed for the request; its late completion dropped).
    LoadTimeouts,
    /// `load_decision: "cost"`: spans of this child judged with
    /// measurements (taken, probed or declined).
    LoadDecisions,
    /// Tokens of this child's spans declined: loading them was expected to
    /// be slower than computing them.
    DeclinedSlowLoadTokens,
    /// Tokens declined because this child's "not ready" wait was expected
    /// to be (or was) longer than computing them: the most it could offer.
    DeclinedSlowWaitTokens,
    /// Requests whose save this child did not see: save admission declined
    /// it (`save_policy`; seen too few times, or the child holds it).
    DeclinedSaves,
    /// Requests this child's "not ready" answer was not waited for (the
    /// load decision: too slow, or its recent waits rarely ended in tokens).
    DeclinedWaits,
}

/// Names of the per-child counters, by `Child` variant: the one source of the
/// stats keys, the Prometheus metrics and the README's list.
pub const CHILD_NAMES: [&str; Child::COUNT] = [
    "lookups",
    "hits",
    "hit_tokens",
    "loads",
    "load_tokens",
    "async_saves",
    "contained_errors",
    "lookup_timeouts",
    "lookup_errors",
    "breaker_opens",
    "breaker_skips",
    "served_tokens",
    "save_completions",
    "load_completions",
    "stray_completions",
    "load_timeouts",
    "load_decisions",
    "declined_slow_load_tokens",
    "declined_slow_wait_tokens",
    "declined_saves",
    "declined_waits",
];

impl Child {
    /// Number of variants (the last one's index + 1).
    pub const COUNT: usize = Child::DeclinedWaits as usize + 1;
}

/// Multiplexer-wide counters, by index into `TOTAL_NAMES`.
#[derive(Clone, Copy, Debug)]
pub enum Total {
    Finished,
    /// `num_extra_cached_tokens` reported, summed.
    ExtraCachedTokens,
    /// Clashes resolved by `first`/`last`.
    ClashesResolved,
    /// Clashes that raised (`error`/`strict`).
    ClashesRaised,
    /// Extra async completions the workers were told to wait for.
    ExtraAsyncSaves,
    /// Worker: requests reported finished sending.
    FinishedSending,
    /// Worker: blocks children failed to load.
    LoadFailedBlocks,
    /// Tokens vLLM's local prefix cache held for finished requests.
    LocalCachedTokens,
}

/// Names of the multiplexer-wide counters, by `Total` variant.
pub const TOTAL_NAMES: [&str; Total::COUNT] = [
    "finished",
    "extra_cached_tokens",
    "clashes_resolved",
    "clashes_raised",
    "extra_async_saves",
    "finished_sending",
    "load_failed_blocks",
    "local_cached_tokens",
];

impl Total {
    /// Number of variants (the last one's index + 1).
    pub const COUNT: usize = Total::LocalCachedTokens as usize + 1;
}

type ChildRow = [AtomicU64; Child::COUNT];
type TotalRow = [AtomicU64; Total::COUNT];

/// Plain values of every counter.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Snapshot {
    pub totals: [u64; Total::COUNT],
    pub children: Vec<[u64; Child::COUNT]>,
}

impl Snapshot {
    pub fn is_zero(&self) -> bool {
        self.totals.iter().all(|&v| v == 0) && self.children.iter().flatten().all(|&v| v == 0)
    }

    /// The counters as kvmux reports them. `sparse` (an interval): zeros
    /// dropped, and the two clash counters folded into one count under the
    /// clash policy's name (`clashes: {policy: n}`); otherwise every counter.
    pub fn report(&self, sparse: bool, clash_policy: &'static str) -> Report {
        let keep = |v: u64| v > 0 || !sparse;
        let children = self
            .children
            .iter()
            .enumerate()
            .map(|(i, row)| {
                let kv = CHILD_NAMES
                    .iter()
                    .zip(row)
                    .filter(|&(_, &v)| keep(v))
                    .map(|(&k, &v)| (k, v))
                    .collect::<Vec<_>>();
                (i, kv)
            })
            .filter(|(_, kv)| !kv.is_empty())
            .collect();
        let folded = [
            Total::ClashesResolved as usize,
            Total::ClashesRaised as usize,
        ];
        let totals = TOTAL_NAMES
            .iter()
            .zip(&self.totals)
            .enumerate()
            .filter(|&(i, (_, &v))| keep(v) && !(sparse && folded.contains(&i)))
            .map(|(_, (&k, &v))| (k, v))
            .collect();
        let clashes: u64 = folded.iter().map(|&i| self.totals[i]).sum();
        Report {
            children,
            totals,
            clashes: (sparse && clashes > 0).then_some((clash_policy, clashes)),
        }
    }
}

/// Counters as reported (see [`Snapshot::report`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Report {
    /// Per child (index) with anything to report: `(counter, value)`.
    pub children: Vec<(usize, Vec<(&'static str, u64)>)>,
    /// The multiplexer-wide counters: `(counter, value)`.
    pub totals: Vec<(&'static str, u64)>,
    /// The clash counters folded, under the clash policy's name.
    pub clashes: Option<(&'static str, u64)>,
}

#[derive(Debug)]
pub struct Counters {
    totals: TotalRow,
    children: Vec<ChildRow>,
    /// Every child's [`Child::Lookups`]: each ready lookup counts for every
    /// child, so one counter stands for all of them (one atomic add per
    /// lookup, not one per child).
    lookups: AtomicU64,
    taken: Mutex<Taken>,
}

/// The counters as last taken, and when.
#[derive(Debug)]
struct Taken {
    snap: Snapshot,
    at: Option<Instant>,
}

fn load<const N: usize>(row: &[AtomicU64; N]) -> [u64; N] {
    std::array::from_fn(|i| row[i].load(Relaxed))
}

impl Counters {
    pub fn new(n_children: usize) -> Self {
        Self {
            totals: Default::default(),
            children: (0..n_children).map(|_| Default::default()).collect(),
            lookups: AtomicU64::new(0),
            taken: Mutex::new(Taken {
                snap: Snapshot {
                    totals: [0; Total::COUNT],
                    children: vec![[0; Child::COUNT]; n_children],
                },
                at: None,
            }),
        }
    }

    pub fn child(&self, child: usize, c: Child, n: u64) {
        if let Some(row) = self.children.get(child) {
            row[c as usize].fetch_add(n, Relaxed);
        }
    }

    /// A lookup was answered: [`Child::Lookups`] of every child.
    pub fn lookup_answered(&self) {
        self.lookups.fetch_add(1, Relaxed);
    }

    pub fn total(&self, t: Total, n: u64) {
        self.totals[t as usize].fetch_add(n, Relaxed);
    }

    pub fn snapshot(&self) -> Snapshot {
        let lookups = self.lookups.load(Relaxed);
        Snapshot {
            totals: load(&self.totals),
            children: self
                .children
                .iter()
                .map(|row| {
                    let mut row = load(row);
                    row[Child::Lookups as usize] += lookups;
                    row
                })
                .collect(),
        }
    }

    /// What changed since the previous take (the first: since start).
    pub fn take_interval(&self) -> Snapshot {
        self.take_interval_every(Duration::ZERO, true)
            .unwrap_or_else(|| self.snapshot())
    }

    /// As [`Counters::take_interval`], but only once `every` has passed
    /// since the previous take, or when `flush`; None otherwise (the counts
    /// stay for the next take: nothing is lost).
    ///
    /// The snapshot is read under the lock: read before it, a caller could
    /// find a newer snapshot already taken by a concurrent caller and
    /// subtract a larger number from a smaller one. Counters only grow, so
    /// a snapshot read after the previous one was stored is never below it.
    pub fn take_interval_every(&self, every: Duration, flush: bool) -> Option<Snapshot> {
        let mut taken = self.taken.lock().unwrap_or_else(|e| e.into_inner());
        let now_t = Instant::now();
        let due = flush
            || taken
                .at
                .map_or(true, |at| now_t.duration_since(at) >= every);
        if !due {
            return None;
        }
        let now = self.snapshot();
        let prev = &taken.snap;
        let delta = Snapshot {
            totals: std::array::from_fn(|i| now.totals[i] - prev.totals[i]),
            children: now
                .children
                .iter()
                .zip(&prev.children)
                .map(|(a, b)| std::array::from_fn(|i| a[i] - b[i]))
                .collect(),
        };
        *taken = Taken {
            snap: now,
            at: Some(now_t),
        };
        Some(delta)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn an_interval_report_drops_zeros_and_folds_clashes_by_policy() {
        let c = Counters::new(2);
        c.child(1, Child::Loads, 2);
        c.total(Total::ClashesResolved, 3);
        c.total(Total::ClashesRaised, 1);
        c.total(Total::Finished, 5);
        let snap = c.snapshot();
        let r = snap.report(true, "first");
        assert_eq!(r.children, vec![(1, vec![("loads", 2)])]);
        assert_eq!(r.totals, vec![("finished", 5)]);
        assert_eq!(r.clashes, Some(("first", 4)));
        let full = snap.report(false, "first");
        assert_eq!(full.children.len(), 2);
        assert_eq!(full.children[0].1.len(), Child::COUNT);
        assert_eq!(
            full.totals.len(),
            Total::COUNT,
            "cumulative: both clash rows kept"
        );
        assert_eq!(full.clashes, None);
        assert_eq!(
            Counters::new(1).snapshot().report(true, "error").clashes,
            None
        );
    }

    #[test]
    fn intervals_add_up_to_the_total() {
        let c = Counters::new(2);
        c.child(1, Child::Loads, 3);
        c.total(Total::Finished, 1);
        let first = c.take_interval();
        assert_eq!(first.children[1][Child::Loads as usize], 3);
        assert!(c.take_interval().is_zero());
        c.total(Total::Finished, 2);
        assert_eq!(c.take_interval().totals[Total::Finished as usize], 2);
        assert_eq!(c.snapshot().totals[Total::Finished as usize], 3);
        c.child(9, Child::Loads, 1); // unknown child: ignored
        c.lookup_answered();
        let every = c.take_interval();
        assert!(every
            .children
            .iter()
            .all(|r| r[Child::Lookups as usize] == 1));
    }

    #[test]
    fn takes_every_interval_lose_nothing_in_between() {
        let c = Counters::new(1);
        let hour = Duration::from_secs(3600);
        c.total(Total::Finished, 1);
        let first = c
            .take_interval_every(hour, false)
            .expect("the first take is due");
        assert_eq!(first.totals[Total::Finished as usize], 1);
        c.total(Total::Finished, 2);
        assert!(c.take_interval_every(hour, false).is_none(), "not due yet");
        c.total(Total::Finished, 4);
        let flushed = c
            .take_interval_every(hour, true)
            .expect("a flush is always due");
        assert_eq!(flushed.totals[Total::Finished as usize], 6);
        assert!(c.take_interval().is_zero());
    }

    #[test]
    fn threads_lose_no_count_across_takes() {
        let c = Arc::new(Counters::new(1));
        let adders: Vec<_> = (0..4)
            .map(|_| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        c.child(0, Child::Lookups, 1);
                    }
                })
            })
            .collect();
        let mut seen = 0;
        for _ in 0..100 {
            seen += c.take_interval().children[0][0];
        }
        for a in adders {
            a.join().unwrap();
        }
        seen += c.take_interval().children[0][0];
        assert_eq!(seen, 40_000);
    }

    #[test]
    fn concurrent_takers_never_underflow_and_share_every_count() {
        // Two threads taking intervals while two add: each count is seen by
        // exactly one taker, and no delta wraps around (a wrapped delta would
        // overflow here, in a debug build, or be near u64::MAX).
        let c = Arc::new(Counters::new(1));
        let adders: Vec<_> = (0..2)
            .map(|_| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    for _ in 0..40_000 {
                        c.child(0, Child::Lookups, 1);
                        c.total(Total::Finished, 1);
                    }
                })
            })
            .collect();
        let takers: Vec<_> = (0..2)
            .map(|_| {
                let c = Arc::clone(&c);
                std::thread::spawn(move || {
                    let (mut child, mut total) = (0u64, 0u64);
                    for _ in 0..100_000 {
                        let d = c.take_interval();
                        assert!(d.children[0][0] <= 80_000 && d.totals[0] <= 80_000);
                        child += d.children[0][0];
                        total += d.totals[0];
                    }
                    (child, total)
                })
            })
            .collect();
        for a in adders {
            a.join().unwrap();
        }
        let (mut child, mut total) = (0, 0);
        for t in takers {
            let (a, b) = t.join().unwrap();
            child += a;
            total += b;
        }
        let last = c.take_interval();
        assert_eq!(child + last.children[0][0], 80_000);
        assert_eq!(total + last.totals[0], 80_000);
    }
}
