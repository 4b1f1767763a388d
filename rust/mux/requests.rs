//! Per-request scheduler-side state of the multiplexer: which child loads a
//! request, how many tokens vLLM already had locally, how many the loading
//! child supplied, and which children took part in the request.
//!
//! The table is a `DashMap`: a sharded map of `RwLock`ed hash tables. Every
//! scheduler event *writes* its request's entry (lookup, allocation, finish),
//! so a read-optimised lock-free map (papaya, flurry, evmap) would pay a
//! clone or a CAS loop per update for nothing; sharded locks give one short
//! uncontended critical section per event, distinct requests on distinct
//! shards never wait for each other, and the entry API makes each event's
//! read-modify-write atomic, which is what free-threaded CPython needs.

use dashmap::DashMap;
use std::str::FromStr;
use std::sync::atomic::{AtomicUsize, Ordering::Relaxed};
use std::time::Instant;
use xxhash_rust::xxh3::Xxh3DefaultBuilder;

/// Most children a multiplexer may have: `took_part` is a bit set in a u64.
pub const MAX_CHILDREN: usize = 64;

/// Which child loads a request when several report matched tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoadPolicy {
    /// The first child in config order with matched tokens (upstream).
    First,
    /// The child with the most matched tokens; ties go to the earlier child.
    Longest,
    /// Every child in order, each asked for the tokens after the earlier
    /// children's hits and loading only its own span of them.
    Compose,
}

impl LoadPolicy {
    pub const ALL: [&'static str; 3] = ["first", "longest", "compose"];
}

impl FromStr for LoadPolicy {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "first" => Ok(LoadPolicy::First),
            "longest" => Ok(LoadPolicy::Longest),
            "compose" => Ok(LoadPolicy::Compose),
            other => Err(format!(
                "unknown load_policy {other:?}; use one of {:?}",
                LoadPolicy::ALL
            )),
        }
    }
}

/// One child's answer to `get_num_new_matched_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChildMatch {
    /// `None`: the child is still looking ("not ready yet").
    pub tokens: Option<u64>,
    pub load_async: bool,
}

/// The multiplexer's answer to `get_num_new_matched_tokens`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lookup {
    /// `None` while any child is not ready.
    pub tokens: Option<u64>,
    pub load_async: bool,
    /// The child that will load, if any.
    pub chosen: Option<usize>,
}

/// The span rule under [`LoadPolicy::Compose`]: the children's spans (in
/// config order) are consecutive, so a load of `total` tokens, fewer than
/// they sum to (vLLM allocated less, or part of a load failed), takes them
/// from the front and cuts them from the end. Each child's share, in order;
/// the shares sum to `min(total, sum of spans)`. The one owner of the cut:
/// what each child is told, what it is credited and what it counts under
/// vLLM's hits-by-source split all come from here.
pub fn cut_spans(spans: impl IntoIterator<Item = u64>, total: u64) -> impl Iterator<Item = u64> {
    let mut left = total;
    spans.into_iter().map(move |t| {
        let share = t.min(left);
        left -= share;
        share
    })
}

/// Pick the loading child among ready answers. With [`LoadPolicy::Compose`]
/// the answers are consecutive spans: every child with tokens loads its
/// own, the first of them is `chosen`, and the load is asynchronous when
/// any of them is.
pub fn choose(policy: LoadPolicy, matches: &[ChildMatch]) -> Lookup {
    if matches.iter().any(|m| m.tokens.is_none()) {
        return Lookup {
            tokens: None,
            load_async: false,
            chosen: None,
        };
    }
    if policy == LoadPolicy::Compose {
        let loaders = || matches.iter().filter(|m| m.tokens.unwrap_or(0) > 0);
        return Lookup {
            // Saturating: children's counts come from outside (a huge one
            // must not wrap around to a small, plausible sum).
            tokens: Some(
                loaders()
                    .map(|m| m.tokens.unwrap_or(0))
                    .fold(0u64, u64::saturating_add),
            ),
            load_async: loaders().any(|m| m.load_async),
            chosen: matches.iter().position(|m| m.tokens.unwrap_or(0) > 0),
        };
    }
    let mut best: Option<(usize, u64)> = None;
    for (i, m) in matches.iter().enumerate() {
        let toks = m.tokens.unwrap_or(0);
        if toks == 0 {
            continue;
        }
        match (policy, best) {
            (_, None) => best = Some((i, toks)),
            (LoadPolicy::Longest, Some((_, b))) if toks > b => best = Some((i, toks)),
            _ => {}
        }
        if policy == LoadPolicy::First {
            break;
        }
    }
    match best {
        Some((i, toks)) => Lookup {
            tokens: Some(toks),
            load_async: matches[i].load_async,
            chosen: Some(i),
        },
        None => Lookup {
            tokens: Some(0),
            load_async: false,
            chosen: None,
        },
    }
}

/// What the table holds for one live request.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RequestState {
    /// The child chosen at the latest lookup (None: nobody loads).
    pub chosen: Option<usize>,
    /// Tokens vLLM had in its local prefix cache at the latest lookup.
    pub local_hit_tokens: u64,
    /// Tokens the chosen child reported at the latest lookup.
    pub matched_tokens: u64,
    /// The chosen child loads asynchronously (its answer at the latest lookup).
    pub load_async: bool,
    /// External tokens vLLM allocated for the chosen child to load; this is
    /// what `num_extra_cached_tokens` reports.
    pub loaded_tokens: u64,
    /// Bit i set: child i took part (was looked up or allocated blocks).
    pub took_part: u64,
    /// When the request was first looked up (kept only when some child has
    /// a lookup deadline).
    pub first_lookup: Option<Instant>,
    /// Bit i set: child i is out of this request's lookups (it missed its
    /// deadline, raised, or its breaker was open): not asked again, a miss.
    pub excluded: u64,
    /// An asynchronous load was allocated and vLLM has not yet been told it
    /// finished receiving (the request waits for remote KV).
    pub load_pending: bool,
    /// An allocation admitted the request (its lookup's split stands).
    pub admitted: bool,
    /// A lookup came after the latest allocation (or before the first):
    /// its split is not admitted yet.
    pub looked: bool,
}

impl RequestState {
    pub fn child_took_part(&self, child: usize) -> bool {
        child < MAX_CHILDREN && self.took_part & (1u64 << child) != 0
    }
}

/// The bit set of `n` children (all of them).
pub fn all_children(n: usize) -> u64 {
    if n >= MAX_CHILDREN {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// Who a lookup asked, for [`RequestTable::lookup_at`].
#[derive(Clone, Copy, Debug, Default)]
pub struct Asked {
    /// When the request was first looked up (kept from the first call).
    pub since: Option<Instant>,
    /// Children out of the request's lookups (added).
    pub excluded: u64,
    /// Children asked (they take part in the request; added).
    pub asked: u64,
}

/// What the table holds per request: its [`RequestState`], alone or inside
/// an aggregate of everything else kept for the request (the scheduler's
/// `Request`), so that one entry of one map is the whole request.
pub trait Entry: Default {
    fn state(&self) -> &RequestState;
    fn state_mut(&mut self) -> &mut RequestState;
}

impl Entry for RequestState {
    #[inline]
    fn state(&self) -> &RequestState {
        self
    }
    #[inline]
    fn state_mut(&mut self) -> &mut RequestState {
        self
    }
}

/// The per-request table: one entry `R` per live request.
#[derive(Debug)]
pub struct RequestTable<R = RequestState> {
    map: DashMap<String, R, Xxh3DefaultBuilder>,
    /// Entries in `map`, kept beside it: `DashMap::len` locks every shard.
    live: AtomicUsize,
    /// Entries with some child excluded.
    excluding: AtomicUsize,
    /// Entries with `load_pending`.
    loading: AtomicUsize,
}

impl<R: Entry> Default for RequestTable<R> {
    fn default() -> Self {
        Self {
            map: DashMap::default(),
            live: AtomicUsize::new(0),
            excluding: AtomicUsize::new(0),
            loading: AtomicUsize::new(0),
        }
    }
}

impl RequestTable {
    pub fn new() -> Self {
        Self::default()
    }
}

impl<R: Entry> RequestTable<R> {
    /// Run `f` on a request's state, made if missing, under its shard's
    /// lock. A live request (the common case) costs no key allocation.
    fn update<T>(&self, req_id: &str, f: impl FnOnce(&mut RequestState) -> T) -> T {
        if let Some(mut st) = self.map.get_mut(req_id) {
            return f(st.state_mut());
        }
        let mut st = self.map.entry(req_id.to_owned()).or_insert_with(|| {
            self.live.fetch_add(1, Relaxed);
            R::default()
        });
        f(st.state_mut())
    }

    /// `f` of a live request's whole entry (None: not live).
    #[inline]
    pub fn with<T>(&self, req_id: &str, f: impl FnOnce(&R) -> T) -> Option<T> {
        self.map.get(req_id).map(|e| f(&e))
    }

    /// `f` of a live request's whole entry, to change it (None: not live).
    /// Its state's flags counted beside the map (excluded, load pending)
    /// are the table's to change, through its own methods.
    #[inline]
    pub fn with_mut<T>(&self, req_id: &str, f: impl FnOnce(&mut R) -> T) -> Option<T> {
        self.map.get_mut(req_id).map(|mut e| f(&mut e))
    }

    /// `f` of every live request's id and entry (shard by shard, each read
    /// locked meanwhile).
    pub fn for_each(&self, mut f: impl FnMut(&str, &R)) {
        for e in self.map.iter() {
            f(e.key(), e.value());
        }
    }

    /// A whole `get_num_new_matched_tokens` event: decide and record.
    ///
    /// Repeating it for the same request (vLLM may) only overwrites the
    /// decision, so it stays side-effect free from vLLM's point of view.
    pub fn lookup(
        &self,
        req_id: &str,
        local_hit_tokens: u64,
        policy: LoadPolicy,
        matches: &[ChildMatch],
    ) -> Lookup {
        let asked = all_children(matches.len());
        let who = Asked {
            since: None,
            excluded: 0,
            asked,
        };
        self.lookup_at(req_id, local_hit_tokens, policy, matches, who)
    }

    /// [`RequestTable::lookup`], also recording who was asked ([`Asked`]:
    /// when the request was first looked up, the children out of its
    /// lookups, the children that take part).
    pub fn lookup_at(
        &self,
        req_id: &str,
        local_hit_tokens: u64,
        policy: LoadPolicy,
        matches: &[ChildMatch],
        who: Asked,
    ) -> Lookup {
        self.relookup_at(req_id, local_hit_tokens, policy, matches, who)
            .0
    }

    /// [`RequestTable::lookup_at`], also returning the request's state as
    /// it was when this lookup is the first after an allocation: vLLM looks
    /// a request up again only from scratch (preempted, or its async load
    /// failed), so that state holds the split of an admission now over.
    pub fn relookup_at(
        &self,
        req_id: &str,
        local_hit_tokens: u64,
        policy: LoadPolicy,
        matches: &[ChildMatch],
        who: Asked,
    ) -> (Lookup, Option<RequestState>) {
        let Asked {
            since,
            excluded,
            asked,
        } = who;
        let decision = choose(policy, matches);
        let before = self.update(req_id, |st| {
            let before = (st.admitted && !st.looked).then_some(*st);
            st.looked = true;
            st.first_lookup = st.first_lookup.or(since);
            if st.excluded == 0 && excluded != 0 {
                self.excluding.fetch_add(1, Relaxed);
            }
            st.excluded |= excluded;
            st.took_part |= asked;
            st.local_hit_tokens = local_hit_tokens;
            if decision.tokens.is_some() {
                st.chosen = decision.chosen;
                st.matched_tokens = decision.tokens.unwrap_or(0);
                st.load_async = decision.load_async;
            }
            before
        });
        (decision, before)
    }

    /// A whole `update_state_after_alloc` event. Returns the child that gets
    /// `num_external` (the others get 0), whether it loads asynchronously,
    /// and the children that took part in the request (those asked on a
    /// lookup; all of them for a request never looked up, who then take
    /// part). vLLM calls this again with 0 once an async load is done; that
    /// second call keeps the loaded count.
    #[allow(clippy::type_complexity)]
    pub fn allocated(
        &self,
        req_id: &str,
        n_children: usize,
        num_external: u64,
    ) -> (Option<(usize, bool)>, u64) {
        self.update(req_id, |st| {
            if st.took_part == 0 {
                st.took_part = all_children(n_children);
            }
            if st.looked {
                // A new admission: what an earlier one loaded was counted
                // when this lookup began it.
                st.loaded_tokens = num_external;
            } else if num_external > 0 {
                st.loaded_tokens = num_external;
            }
            st.admitted = true;
            st.looked = false;
            let planned = st
                .chosen
                .filter(|_| num_external > 0)
                .map(|c| (c, st.load_async));
            (planned, st.took_part)
        })
    }

    /// The chosen child for a request, if any.
    pub fn chosen(&self, req_id: &str) -> Option<usize> {
        self.map.get(req_id).and_then(|s| s.state().chosen)
    }

    /// Some external tokens of a request failed to load: vLLM recomputes
    /// them, so they no longer count as supplied.
    pub fn load_failed(&self, req_id: &str, failed_tokens: u64) {
        if let Some(mut e) = self.map.get_mut(req_id) {
            let st = e.state_mut();
            st.loaded_tokens = st.loaded_tokens.saturating_sub(failed_tokens);
        }
    }

    /// An asynchronous load of a live request was allocated: vLLM waits
    /// for its "finished receiving".
    pub fn load_started(&self, req_id: &str) {
        if let Some(mut e) = self.map.get_mut(req_id) {
            let st = e.state_mut();
            if !st.load_pending {
                st.load_pending = true;
                self.loading.fetch_add(1, Relaxed);
            }
        }
    }

    /// vLLM is told `req_id` finished receiving. True if it is a live
    /// request (its load is no longer pending).
    pub fn load_reported(&self, req_id: &str) -> bool {
        let Some(mut e) = self.map.get_mut(req_id) else {
            return false;
        };
        let st = e.state_mut();
        if st.load_pending {
            st.load_pending = false;
            self.loading.fetch_sub(1, Relaxed);
        }
        true
    }

    /// Some live request waits for its asynchronous load.
    pub fn any_loading(&self) -> bool {
        self.loading.load(Relaxed) != 0
    }

    /// A `request_finished` event: the entry leaves the table (None if the
    /// request was never seen or already finished).
    pub fn finish(&self, req_id: &str) -> Option<R> {
        let (_, entry) = self.map.remove(req_id)?;
        let st = entry.state();
        self.live.fetch_sub(1, Relaxed);
        if st.excluded != 0 {
            self.excluding.fetch_sub(1, Relaxed);
        }
        if st.load_pending {
            self.loading.fetch_sub(1, Relaxed);
        }
        Some(entry)
    }

    pub fn get(&self, req_id: &str) -> Option<RequestState> {
        self.map.get(req_id).map(|s| *s.state())
    }

    pub fn len(&self) -> usize {
        self.live.load(Relaxed)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Some live request has a child excluded from its lookups.
    pub fn any_excluded(&self) -> bool {
        self.excluding.load(Relaxed) != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::sync::Arc;

    fn m(tokens: Option<u64>, load_async: bool) -> ChildMatch {
        ChildMatch { tokens, load_async }
    }

    #[test]
    fn any_not_ready_child_means_not_ready() {
        let got = choose(LoadPolicy::First, &[m(Some(32), false), m(None, false)]);
        assert_eq!(got.tokens, None);
        assert_eq!(got.chosen, None);
    }

    #[test]
    fn first_policy_takes_first_child_with_hits() {
        let got = choose(
            LoadPolicy::First,
            &[m(Some(0), false), m(Some(16), true), m(Some(64), false)],
        );
        assert_eq!(
            got,
            Lookup {
                tokens: Some(16),
                load_async: true,
                chosen: Some(1)
            }
        );
    }

    #[test]
    fn longest_policy_takes_most_tokens_ties_to_earlier() {
        let got = choose(
            LoadPolicy::Longest,
            &[m(Some(16), false), m(Some(64), true), m(Some(64), false)],
        );
        assert_eq!(
            got,
            Lookup {
                tokens: Some(64),
                load_async: true,
                chosen: Some(1)
            }
        );
    }

    #[test]
    fn spans_are_cut_from_the_end_to_the_load() {
        let cut =
            |spans: &[u64], total| cut_spans(spans.iter().copied(), total).collect::<Vec<_>>();
        assert_eq!(cut(&[32, 16, 64], 112), vec![32, 16, 64]);
        assert_eq!(cut(&[32, 16, 64], 40), vec![32, 8, 0]);
        assert_eq!(cut(&[32, 16, 64], 0), vec![0, 0, 0]);
        // More than the spans: each keeps its own (the chosen child loads the rest).
        assert_eq!(cut(&[32, 0, 16], 100), vec![32, 0, 16]);
    }

    #[test]
    fn no_hits_means_zero_and_nobody_chosen() {
        let got = choose(LoadPolicy::Longest, &[m(Some(0), true), m(Some(0), false)]);
        assert_eq!(
            got,
            Lookup {
                tokens: Some(0),
                load_async: false,
                chosen: None
            }
        );
    }

    #[test]
    fn compose_sums_the_spans_and_loads_async_if_any_loader_does() {
        let got = choose(
            LoadPolicy::Compose,
            &[m(Some(0), false), m(Some(32), false), m(Some(16), true)],
        );
        assert_eq!(
            (got.tokens, got.chosen, got.load_async),
            (Some(48), Some(1), true)
        );
        let none = choose(LoadPolicy::Compose, &[m(Some(0), false), m(Some(0), false)]);
        assert_eq!((none.tokens, none.chosen), (Some(0), None));
        assert_eq!(
            choose(LoadPolicy::Compose, &[m(Some(16), false), m(None, false)]).tokens,
            None
        );
    }

    #[test]
    fn lifecycle_records_then_finish_removes() {
        let t = RequestTable::new();
        t.lookup(
            "r",
            32,
            LoadPolicy::First,
            &[m(Some(0), false), m(Some(48), false)],
        );
        assert_eq!(t.allocated("r", 2, 48), (Some((1, false)), 0b11));
        // The second call vLLM makes after an async load keeps the count.
        assert_eq!(t.allocated("r", 2, 0), (None, 0b11));
        let st = t.finish("r").unwrap();
        assert_eq!(
            (st.chosen, st.local_hit_tokens, st.loaded_tokens),
            (Some(1), 32, 48)
        );
        assert!(st.child_took_part(0) && st.child_took_part(1) && !st.child_took_part(2));
        assert!(t.finish("r").is_none());
        assert!(t.is_empty());
    }

    #[test]
    fn not_ready_lookup_keeps_earlier_decision() {
        let t = RequestTable::new();
        t.lookup("r", 0, LoadPolicy::First, &[m(Some(16), false)]);
        t.lookup("r", 0, LoadPolicy::First, &[m(None, false)]);
        assert_eq!(t.chosen("r"), Some(0));
    }

    #[test]
    fn load_failure_reduces_supplied_tokens() {
        let t = RequestTable::new();
        t.lookup("r", 0, LoadPolicy::First, &[m(Some(64), false)]);
        t.allocated("r", 1, 64);
        t.load_failed("r", 100);
        assert_eq!(t.finish("r").unwrap().loaded_tokens, 0);
    }

    #[test]
    fn threads_on_shared_ids_leave_the_table_empty() {
        let t = Arc::new(RequestTable::new());
        let handles: Vec<_> = (0..4)
            .map(|w| {
                let t = Arc::clone(&t);
                std::thread::spawn(move || {
                    for i in 0..5_000u64 {
                        let id = format!("req-{}", i % 64);
                        t.lookup(&id, i, LoadPolicy::Longest, &[m(Some(i % 3), false)]);
                        t.allocated(&id, 1, w);
                        t.finish(&id);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
        assert!(t.is_empty());
    }

    proptest! {
        /// The chosen child always reported tokens > 0, and under `longest`
        /// no other child reported more; under `first` no earlier child had hits.
        #[test]
        fn choice_is_consistent(answers in proptest::collection::vec((0u64..5, any::<bool>()), 1..8)) {
            let ms: Vec<_> = answers.iter().map(|&(t, a)| m(Some(t * 16), a)).collect();
            for policy in [LoadPolicy::First, LoadPolicy::Longest] {
                let got = choose(policy, &ms);
                match got.chosen {
                    None => prop_assert!(ms.iter().all(|x| x.tokens == Some(0))),
                    Some(i) => {
                        let ti = ms[i].tokens.unwrap();
                        prop_assert!(ti > 0);
                        prop_assert_eq!(got.tokens, Some(ti));
                        prop_assert_eq!(got.load_async, ms[i].load_async);
                        for (j, x) in ms.iter().enumerate() {
                            let tj = x.tokens.unwrap();
                            if policy == LoadPolicy::First && j < i { prop_assert_eq!(tj, 0); }
                            if policy == LoadPolicy::Longest {
                                prop_assert!(tj <= ti);
                                if j < i { prop_assert!(tj < ti); }
                            }
                        }
                    }
                }
            }
        }
    }
}
