//! The multiplexer's rules, one type per role.
//!
//! [`SchedulerMux`] (`scheduler/`, a file per phase) decides, for every scheduler-side
//! event of a request, what the
//! multiplexer answers vLLM and what it remembers: which child loads, how
//! many tokens it supplied, which children took part, how many async saves
//! the workers must wait for, which params reach vLLM, which failures are
//! contained. It never calls a child itself: the caller hands it each
//! child's answer through a closure (`ask(i)`), so every rule runs under
//! `cargo test` with plain Rust children, and the bindings only convert
//! Python answers to [`ChildMatch`], `bool` and [`Params`].
//!
//! Each vLLM scheduler hook, through the layers (grep the hook's name:
//! the Python connector's method and the bindings' `PySchedulerMux`
//! method bear it; the core's method is named here):
//!
//! | vLLM hook                          | core (`SchedulerMux`)             | file                        |
//! |------------------------------------|-----------------------------------|-----------------------------|
//! | `get_num_new_matched_tokens`       | `lookup`                          | `scheduler/lookup.rs`       |
//! | `update_state_after_alloc`         | `allocated`                       | `scheduler/admission.rs`    |
//! | `request_finished`                 | `finish` ([`FinishHooks`])        | `scheduler/finish.rs`       |
//! | `request_finished_all_groups`      | `finish_route`, `finish`          | `scheduler/finish.rs`       |
//! | `register_finished_partial_tail`   | `partial_tail`                    | `scheduler/finish.rs`       |
//! | `build_connector_meta`             | `take_outbox`                     | `scheduler/mod.rs`          |
//! | `update_connector_output`          | `load_errors`, `reported`         | `scheduler/load_errors.rs`, `scheduler/held.rs` |
//! | `get_kv_connector_stats`           | `take_interval_every`             | `scheduler/mod.rs`          |
//! | `get_external_cache_hit_sources`   | `hit_sources`                     | `sources.rs`                |
//!
//! The rest of the multiplexer is its own modules here: [`requests`] (the
//! per-request table, load policies), [`merge`] (the clash-checked merge of
//! transfer params), [`completions`] (the worker side's completions, with
//! each child's identity), [`breaker`] (a circuit breaker per child) and
//! [`stats`] (atomic counters, taken per interval).

use std::collections::HashMap;
use std::time::Duration;

use smallvec::{smallvec, SmallVec};

use crate::error::{ChildFault, MuxError};
use crate::mux::merge::{Clash, Merged, ValueEq};
use crate::mux::requests::{ChildMatch, Lookup, MAX_CHILDREN};

pub mod admit;
pub mod breaker;
pub mod completions;
pub mod cost;
pub mod hma;
pub mod merge;
pub mod notice;
pub mod plan;
pub mod requests;
mod scheduler;
pub mod settings;
mod sources;
pub mod stats;
mod worker;
pub use scheduler::{
    wall_clock, About, ChildAnswer, ChildTimeline, Credits, FinishHooks, FinishResult, Held,
    ParamsError, PartialTail, SchedulerMux, Timeline,
};
pub use sources::{combine as combine_sources, Span};
pub use worker::WorkerMux;

/// The key the multiplexer adds to a finished request's params when the
/// request asks for it: the tokens its chosen child supplied.
pub const EXTRA_KEY: &str = "num_extra_cached_tokens";
/// The key a request asks for, with any value, to get back the tokens each
/// child and vLLM's local prefix cache supplied ([`Supplied`]).
pub const BY_CHILD_KEY: &str = "cached_tokens_by_child";
/// In [`BY_CHILD_KEY`]'s answer: vLLM's local prefix cache.
pub const LOCAL_KEY: &str = "local_prefix_cache";

/// A child's answer of no tokens (also what an excluded child counts as).
const MISS: ChildMatch = ChildMatch {
    tokens: Some(0),
    load_async: false,
};

/// One value per child, on the stack for the usual handful of children:
/// the hooks that run once per request allocate nothing for them.
pub type PerChild<T> = SmallVec<[T; INLINE]>;
/// Children a [`PerChild`] holds on the stack.
pub const INLINE: usize = 8;

/// `n` zeros, one per child. Not `smallvec![0; n]`: that fills a buffer
/// with a `memset` call and copies it in, a store-forwarding stall that
/// cost the allocation and the finish ~10 ns each.
fn zeros(n: usize) -> PerChild<u64> {
    if n <= INLINE {
        SmallVec::from_buf_and_len([0; INLINE], n)
    } else {
        smallvec![0; n]
    }
}

/// Which of the multiplexer's own params a finishing request asked for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Want {
    /// [`EXTRA_KEY`]: the tokens the children supplied, summed.
    pub extra: bool,
    /// [`BY_CHILD_KEY`]: the tokens each child and the local cache supplied.
    pub by_child: bool,
}

impl Want {
    pub fn any(self) -> bool {
        self.extra || self.by_child
    }
}

/// Who supplied a finished request's cached tokens, for its own params.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Supplied {
    pub want: Want,
    /// Tokens the children supplied beyond the local prefix cache (summed).
    pub extra: u64,
    /// Per child, the tokens it supplied (loads that failed not counted).
    pub by_child: PerChild<u64>,
    /// Tokens vLLM's local prefix cache held.
    pub local: u64,
}

/// The connector hooks the multiplexer runs, as vLLM names them.
pub mod hook {
    pub const LOOKUP: &str = "get_num_new_matched_tokens";
    pub const ALLOC: &str = "update_state_after_alloc";
    pub const FINISHED: &str = "request_finished";
    pub const FINISHED_ALL_GROUPS: &str = "request_finished_all_groups";
    pub const PARTIAL_TAIL: &str = "register_finished_partial_tail";
    pub const ON_NEW_REQUEST: &str = "on_new_request";
    pub const BUILD_META: &str = "build_connector_meta";
    pub const UPDATE_OUTPUT: &str = "update_connector_output";
    pub const STATS: &str = "get_kv_connector_stats";
    pub const HIT_SOURCES: &str = "get_external_cache_hit_sources";

    /// vLLM's scheduler-side hooks that are `SchedulerMux`'s own methods:
    /// the connector's are these (one table; the connector's declarations
    /// and the stub `_core.pyi` are checked against it by the tests).
    pub const SCHEDULER: [&str; 10] = [
        LOOKUP,
        ALLOC,
        FINISHED,
        FINISHED_ALL_GROUPS,
        PARTIAL_TAIL,
        ON_NEW_REQUEST,
        BUILD_META,
        UPDATE_OUTPUT,
        STATS,
        HIT_SOURCES,
    ];

    /// What a child's answer to `hook` must be, for error messages.
    pub fn contract(hook: &str) -> &'static str {
        match hook {
            LOOKUP => "(int >= 0 or None, bool)",
            FINISHED | FINISHED_ALL_GROUPS => "(bool, dict or None)",
            PARTIAL_TAIL => "a bool",
            _ => "what vLLM's connector interface documents",
        }
    }
}

/// A finished request's params as one child (or the multiplexer) returned
/// them. A single source is handed back as it is; only a merge reads it.
pub trait Params {
    type Value: ValueEq<Error = Self::Error>;
    type Error;
    /// The key/value pairs, for a merge. A malformed source (a key that is
    /// not a string) is a [`ChildFault::Malformed`].
    #[allow(clippy::type_complexity)]
    fn entries(&self) -> Result<Vec<(String, Self::Value)>, ChildFault<Self::Error>>;
}

/// One child's answer to a finish hook.
#[derive(Debug, Clone, PartialEq)]
pub struct ChildFinish<P> {
    pub async_save: bool,
    pub params: Option<P>,
}

/// The params a finished request returns to vLLM.
#[derive(Debug, PartialEq)]
pub enum FinishedParams<P, V> {
    /// One source only: its params, uncopied.
    Source(P),
    /// Several sources, merged under the clash policy (first-seen order); a
    /// key the request asked for that several sources returned holds every
    /// source's value ([`Merged::others`]).
    Merged(Vec<Merged<V>>),
}

/// A failure of a child on a request it never took part in, contained by
/// the multiplexer (see [`SchedulerMux::finish`]); the caller logs it.
#[derive(Debug)]
pub struct Contained<E> {
    pub child: usize,
    pub hook: &'static str,
    /// The first contained failure of this child (log it loudly).
    pub first: bool,
    pub fault: ChildFault<E>,
}

/// The multiplexer's answer to a lookup (it reads as the [`Lookup`]).
#[derive(Debug)]
pub struct Looked<E> {
    pub lookup: Lookup,
    /// Lookup failures contained as misses (children with a breaker).
    pub contained: Vec<Contained<E>>,
}

impl<E> std::ops::Deref for Looked<E> {
    type Target = Lookup;
    fn deref(&self) -> &Lookup {
        &self.lookup
    }
}

/// The multiplexer's answer to a finish hook.
#[derive(Debug)]
pub struct Finished<P, V, E> {
    pub async_save: bool,
    pub params: Option<FinishedParams<P, V>>,
    /// Clashes resolved (by `first`/`last`, or by the key's [`KeyRule`]) on
    /// keys never warned about before.
    pub new_clashes: Vec<Clash>,
    pub contained: Vec<Contained<E>>,
}

/// What the scheduler side sends its workers with the next step's metadata
/// (see [`crate::mux::completions`]).
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Outbox {
    /// Finished requests saved asynchronously -> (bit set of the children
    /// that save it, how many of their completions the workers wait for).
    pub saves: HashMap<String, (u64, u32)>,
    /// Requests loading asynchronously -> bit set of the children whose
    /// asynchronous loads the workers wait for (one, or several spans
    /// under `compose`).
    pub loads: HashMap<String, u64>,
    /// Of those loaded by a child with a load deadline: the device blocks
    /// (group 0) the load writes, which a worker reports as load errors if
    /// it misses the deadline (vLLM without failed receives).
    pub load_blocks: HashMap<String, Vec<u32>>,
}

impl Outbox {
    pub fn is_empty(&self) -> bool {
        self.saves.is_empty() && self.loads.is_empty() && self.load_blocks.is_empty()
    }
}

/// Children's names must be 1 to [`MAX_CHILDREN`].
fn check_names<E>(names: &[String]) -> Result<(), MuxError<E>> {
    if names.is_empty() || names.len() > MAX_CHILDREN {
        return Err(MuxError::Config(format!(
            "a multiplexer needs 1 to {MAX_CHILDREN} children, got {}",
            names.len()
        )));
    }
    Ok(())
}

/// A per-child setting must have one entry per child.
fn one_per_child<E>(what: &str, n: usize, got: usize) -> Result<(), MuxError<E>> {
    if got == n {
        return Ok(());
    }
    Err(MuxError::Config(format!(
        "one {what} per child ({n}), got {got}"
    )))
}

/// Bit set of the children with a deadline.
fn deadline_bits(deadlines: &[Option<Duration>]) -> u64 {
    deadlines
        .iter()
        .enumerate()
        .filter(|(_, d)| d.is_some())
        .fold(0, |b, (i, _)| b | (1u64 << i))
}
