//! Counters of the multiplexer, kept with relaxed atomics so that any thread
//! may bump them without a lock. A snapshot is a plain struct.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Per-child counters.
#[derive(Debug, Default)]
pub struct ChildCounters {
    /// Lookups answered with a count (not "not ready").
    pub lookups: AtomicU64,
    /// Lookups that reported more than 0 matched tokens.
    pub hits: AtomicU64,
    /// Matched tokens reported, summed over hit lookups.
    pub hit_tokens: AtomicU64,
    /// Requests this child was chosen to load (allocated external tokens).
    pub loads: AtomicU64,
    /// External tokens allocated for this child to load.
    pub load_tokens: AtomicU64,
    /// Async saves this child started on finished requests.
    pub async_saves: AtomicU64,
    /// Failures of this child on requests it never took part in, contained.
    pub contained_errors: AtomicU64,
}

/// Counters of one multiplexer instance.
#[derive(Debug)]
pub struct Counters {
    pub children: Vec<ChildCounters>,
    pub finished: AtomicU64,
    /// `num_extra_cached_tokens` reported, summed.
    pub extra_cached_tokens: AtomicU64,
    /// Clashes resolved by `first`/`last`.
    pub clashes_resolved: AtomicU64,
    /// Clashes that raised (`error`/`strict`).
    pub clashes_raised: AtomicU64,
    /// Extra async completions the workers were told to wait for.
    pub extra_async_saves: AtomicU64,
    /// Requests whose load failed (some or all blocks), from the workers.
    pub load_failures: AtomicU64,
}

impl Counters {
    pub fn new(n_children: usize) -> Self {
        Self {
            children: (0..n_children).map(|_| ChildCounters::default()).collect(),
            finished: AtomicU64::new(0),
            extra_cached_tokens: AtomicU64::new(0),
            clashes_resolved: AtomicU64::new(0),
            clashes_raised: AtomicU64::new(0),
            extra_async_saves: AtomicU64::new(0),
            load_failures: AtomicU64::new(0),
        }
    }

    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Relaxed);
    }

    pub fn get(counter: &AtomicU64) -> u64 {
        counter.load(Relaxed)
    }
}
