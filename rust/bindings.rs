//! The only file that knows PyO3: thin, coarse wrappers over the core.
//!
//! Each method covers one whole connector event (a lookup over every child,
//! a whole `request_finished`, a whole `get_finished` batch), so one Python
//! call into Rust replaces a Python loop.

use dashmap::DashSet;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString, PyTuple};

use std::sync::{Mutex, MutexGuard};

use pyo3::types::PyBytes;

use crate::block_index::{chain_token_hashes, BlockIndex, Reach, ServablePrefix};
use crate::merge::{self, ClashPolicy, MergeError, ValueEq};
use crate::requests::{ChildMatch, LoadPolicy, RequestTable, MAX_CHILDREN};
use crate::saves::SaveCountdown;
use crate::stats::{Child, Counters, Snapshot, Total, CHILD_NAMES, TOTAL_NAMES};

/// The key kvmux itself adds to a finished request's params on request.
const EXTRA_KEY: &str = "num_extra_cached_tokens";
/// The name kvmux's own params go by in clash reports.
const SELF_NAME: &str = "kvmux";

/// Raise `kvmux.errors.<name>(*args)`. Only reached on error paths.
fn kvmux_error<'py, A>(py: Python<'py>, name: &str, args: A) -> PyErr
where
    A: pyo3::call::PyCallArgs<'py>,
{
    let build = || -> PyResult<PyErr> {
        let cls = py.import("kvmux.errors")?.getattr(name)?;
        Ok(PyErr::from_value(cls.call1(args)?))
    };
    build().unwrap_or_else(|e| e)
}

/// A Python value compared with Python's `==`.
struct PyVal<'py>(Bound<'py, PyAny>);

impl ValueEq for PyVal<'_> {
    type Error = PyErr;
    fn value_eq(&self, other: &Self) -> PyResult<bool> {
        self.0.eq(&other.0)
    }
}

/// Scheduler-side state of one `KvmuxConnector`.
#[pyclass(frozen, module = "kvmux._core")]
pub struct MuxCore {
    names: Vec<String>,
    clash: ClashPolicy,
    load: LoadPolicy,
    table: RequestTable,
    counters: Counters,
    warned_keys: DashSet<String>,
}

impl MuxCore {
    fn name(&self, i: usize) -> &str {
        self.names.get(i).map_or(SELF_NAME, String::as_str)
    }

    fn parse_match(
        &self,
        py: Python<'_>,
        i: usize,
        ans: &Bound<'_, PyAny>,
    ) -> PyResult<ChildMatch> {
        let bad = |why: String| {
            kvmux_error(
                py,
                "KvmuxChildError",
                (
                    self.name(i).to_owned(),
                    "get_num_new_matched_tokens",
                    format!("{why}; it must return (int >= 0 or None, bool)"),
                ),
            )
        };
        let tup = ans
            .cast::<PyTuple>()
            .map_err(|_| bad(format!("returned {}", repr(ans))))?;
        if tup.len() != 2 {
            return Err(bad(format!("returned a tuple of {} items", tup.len())));
        }
        let (toks, load_async) = (tup.get_item(0)?, tup.get_item(1)?);
        let tokens = if toks.is_none() {
            None
        } else {
            let n: i64 = toks
                .extract()
                .map_err(|_| bad(format!("returned token count {}", repr(&toks))))?;
            if n < 0 {
                return Err(bad(format!("returned a negative token count {n}")));
            }
            Some(n as u64)
        };
        let load_async: bool = load_async
            .extract()
            .map_err(|_| bad(format!("returned load_async {}", repr(&load_async))))?;
        if load_async && tokens == Some(0) {
            return Err(bad("returned load_async=True with 0 tokens".to_owned()));
        }
        Ok(ChildMatch { tokens, load_async })
    }
}

fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string())
}

#[pymethods]
impl MuxCore {
    #[new]
    fn new(names: Vec<String>, clash_policy: &str, load_policy: &str) -> PyResult<Self> {
        if names.is_empty() || names.len() > MAX_CHILDREN {
            return Err(PyValueError::new_err(format!(
                "a multiplexer needs 1 to {MAX_CHILDREN} children, got {}",
                names.len()
            )));
        }
        Ok(Self {
            counters: Counters::new(names.len()),
            names,
            clash: clash_policy.parse().map_err(PyValueError::new_err)?,
            load: load_policy.parse().map_err(PyValueError::new_err)?,
            table: RequestTable::new(),
            warned_keys: DashSet::new(),
        })
    }

    /// One `get_num_new_matched_tokens` event: every child's answer in, the
    /// multiplexer's `(tokens or None, load_async)` out.
    fn lookup(
        &self,
        py: Python<'_>,
        req_id: &str,
        num_computed_tokens: u64,
        answers: &Bound<'_, PyList>,
    ) -> PyResult<(Option<u64>, bool)> {
        if answers.len() != self.names.len() {
            return Err(PyValueError::new_err(format!(
                "expected {} answers, got {}",
                self.names.len(),
                answers.len()
            )));
        }
        let mut matches = [ChildMatch {
            tokens: None,
            load_async: false,
        }; MAX_CHILDREN];
        for (i, ans) in answers.iter().enumerate() {
            matches[i] = self.parse_match(py, i, &ans)?;
        }
        let matches = &matches[..self.names.len()];
        let got = self
            .table
            .lookup(req_id, num_computed_tokens, self.load, matches);
        if got.tokens.is_some() {
            for (i, m) in matches.iter().enumerate() {
                let toks = m.tokens.unwrap_or(0);
                self.counters.child(i, Child::Lookups, 1);
                if toks > 0 {
                    self.counters.child(i, Child::Hits, 1);
                    self.counters.child(i, Child::HitTokens, toks);
                }
            }
        }
        Ok((got.tokens, got.load_async))
    }

    /// One `update_state_after_alloc` event: the index of the child that gets
    /// `num_external_tokens` (None: every child gets 0).
    fn allocated(&self, req_id: &str, num_external_tokens: u64) -> Option<usize> {
        let chosen = self
            .table
            .allocated(req_id, self.names.len(), num_external_tokens);
        if let Some(i) = chosen {
            self.counters.child(i, Child::Loads, 1);
            self.counters
                .child(i, Child::LoadTokens, num_external_tokens);
        }
        chosen
    }

    /// Drop a request's state without counting it as finished (a child
    /// failed on it). True if there was state.
    fn forget(&self, req_id: &str) -> bool {
        self.table.finish(req_id).is_some()
    }

    /// The child chosen to load a request, if any.
    fn chosen(&self, req_id: &str) -> Option<usize> {
        self.table.chosen(req_id)
    }

    /// Whether child `child` took part in a live request (looked up or
    /// allocated); False for an unknown request.
    fn took_part(&self, req_id: &str, child: usize) -> bool {
        self.table
            .get(req_id)
            .is_some_and(|s| s.child_took_part(child))
    }

    /// The load planned for a live request: `(local prefix tokens, external
    /// tokens the chosen child loads after them)`; None when nothing loads.
    fn loading(&self, req_id: &str) -> Option<(u64, u64)> {
        self.table
            .get(req_id)
            .filter(|s| s.loaded_tokens > 0)
            .map(|s| (s.local_hit_tokens, s.loaded_tokens))
    }

    /// External tokens of a request failed to load (vLLM recomputes them).
    fn load_failed(&self, req_id: &str, failed_tokens: u64) {
        self.table.load_failed(req_id, failed_tokens);
    }

    /// One `request_finished` event. `results[i]` is child i's
    /// `(async_save, params or None)`; `want_extra` says whether the request
    /// asked for `num_extra_cached_tokens`.
    ///
    /// Returns `(async_save, merged params or None, extra async completions,
    /// clashes to warn about or None)`. The request's state is gone after
    /// this call, whether it succeeds or raises.
    #[allow(clippy::type_complexity)]
    fn finish<'py>(
        &self,
        py: Python<'py>,
        req_id: &str,
        results: &Bound<'py, PyList>,
        want_extra: bool,
    ) -> PyResult<(
        bool,
        Option<Bound<'py, PyDict>>,
        u32,
        Option<Vec<(String, String, String)>>,
    )> {
        let seen = self.table.finish(req_id);
        let state = seen.unwrap_or_default();
        self.counters.total(Total::Finished, 1);
        let mut n_async = 0u32;
        let mut sources: Vec<(usize, Bound<'py, PyDict>)> = Vec::with_capacity(results.len() + 1);
        for (i, res) in results.iter().enumerate() {
            let bad = |why: String| {
                kvmux_error(
                    py,
                    "KvmuxChildError",
                    (
                        self.name(i).to_owned(),
                        "request_finished",
                        format!("{why}; it must return (bool, dict or None)"),
                    ),
                )
            };
            let tup = res
                .cast::<PyTuple>()
                .ok()
                .filter(|t| t.len() == 2)
                .ok_or_else(|| bad(format!("returned {}", repr(&res))))?;
            let is_async: bool = tup
                .get_item(0)?
                .extract()
                .map_err(|_| bad(format!("returned async_save {}", repr(&res))))?;
            if is_async {
                n_async += 1;
                self.counters.child(i, Child::AsyncSaves, 1);
            }
            let params = tup.get_item(1)?;
            if !params.is_none() {
                let d = params.cast_into::<PyDict>().map_err(|e| {
                    bad(format!("returned params {}", repr(e.into_inner().as_any())))
                })?;
                sources.push((i, d));
            }
        }
        if want_extra {
            self.counters
                .total(Total::ExtraCachedTokens, state.loaded_tokens);
            let own = PyDict::new(py);
            own.set_item(EXTRA_KEY, state.loaded_tokens)?;
            sources.push((self.names.len(), own));
        }
        // Extra completions are awaited only for a request kvmux tracked: a
        // request it never saw (aborted before any lookup) or finishes a
        // second time has no blocks anyone is saving, and an expectation the
        // workers can never meet would leak.
        let extra_saves = if seen.is_some() {
            n_async.saturating_sub(1)
        } else {
            0
        };
        self.counters
            .total(Total::ExtraAsyncSaves, u64::from(extra_saves));
        let (params, warn) = match sources.len() {
            0 => (None, None),
            // One source: hand its dict back as it is, no copy.
            1 => (sources.pop().map(|(_, d)| d), None),
            _ => {
                let (d, warn) = self.merge(py, &sources)?;
                (Some(d), warn)
            }
        };
        Ok((n_async > 0, params, extra_saves, warn))
    }

    /// Requests the table still holds.
    fn __len__(&self) -> usize {
        self.table.len()
    }

    /// Forget every request (vLLM's `reset_cache` does not call this: live
    /// requests keep their state; it is for shutdown).
    fn clear(&self) {
        self.table.clear();
    }

    /// Cumulative counters: `{"children": {name: {...}}, "finished": n, ...,
    /// "live_requests": n}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = self.counters_dict(py, &self.counters.snapshot(), false)?;
        out.set_item("live_requests", self.table.len())?;
        Ok(out)
    }

    /// Counters changed since the previous call, nested and without zeros,
    /// clashes keyed by policy; None when nothing changed. One call per stats
    /// interval, for vLLM's `get_kv_connector_stats`.
    fn take_interval<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let delta = self.counters.take_interval();
        if delta.is_zero() {
            return Ok(None);
        }
        self.counters_dict(py, &delta, true).map(Some)
    }

    /// Worker side: requests reported finished sending, blocks failed to load.
    fn count_worker(&self, finished_sending: u64, load_failed_blocks: u64) {
        self.counters
            .total(Total::FinishedSending, finished_sending);
        self.counters
            .total(Total::LoadFailedBlocks, load_failed_blocks);
    }

    /// Count a contained failure of child `child` (see the connector).
    fn count_contained(&self, child: usize) {
        self.counters.child(child, Child::ContainedErrors, 1);
    }

    #[getter]
    fn clash_policy(&self) -> &'static str {
        self.clash.as_str()
    }

    #[getter]
    fn names(&self) -> Vec<String> {
        self.names.clone()
    }
}

type Warnings = Option<Vec<(String, String, String)>>;

impl MuxCore {
    /// Counters as a dict; `sparse` drops zeros and folds the clash counters
    /// into `{"clashes": {policy: n}}`.
    fn counters_dict<'py>(
        &self,
        py: Python<'py>,
        snap: &Snapshot,
        sparse: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let children = PyDict::new(py);
        for (name, row) in self.names.iter().zip(&snap.children) {
            let d = PyDict::new(py);
            for (k, &v) in CHILD_NAMES.iter().zip(row) {
                if v > 0 || !sparse {
                    d.set_item(k, v)?;
                }
            }
            if !d.is_empty() {
                children.set_item(name, d)?;
            }
        }
        if !children.is_empty() || !sparse {
            out.set_item("children", children)?;
        }
        let clashes = snap.totals[Total::ClashesResolved as usize]
            + snap.totals[Total::ClashesRaised as usize];
        for (i, (k, &v)) in TOTAL_NAMES.iter().zip(&snap.totals).enumerate() {
            let is_clash =
                i == Total::ClashesResolved as usize || i == Total::ClashesRaised as usize;
            if sparse && (v == 0 || is_clash) {
                continue;
            }
            out.set_item(k, v)?;
        }
        if sparse && clashes > 0 {
            let by_policy = PyDict::new(py);
            by_policy.set_item(self.clash.as_str(), clashes)?;
            out.set_item("clashes", by_policy)?;
        }
        Ok(out)
    }

    /// Merge several children's params under the clash policy. Returns the
    /// merged dict and the clashes resolved by `first`/`last` whose key has
    /// not been warned about yet (the caller logs them once).
    fn merge<'py>(
        &self,
        py: Python<'py>,
        sources: &[(usize, Bound<'py, PyDict>)],
    ) -> PyResult<(Bound<'py, PyDict>, Warnings)> {
        let mut pairs = Vec::with_capacity(sources.len());
        for (i, d) in sources {
            let mut kv = Vec::with_capacity(d.len());
            for (k, v) in d.iter() {
                let key = k.cast::<PyString>().map_err(|_| {
                    kvmux_error(
                        py,
                        "KvmuxChildError",
                        (
                            self.name(*i).to_owned(),
                            "request_finished",
                            format!("returned a params key {} that is not a str", repr(&k)),
                        ),
                    )
                })?;
                kv.push((key.to_str()?.to_owned(), PyVal(v)));
            }
            pairs.push((*i, kv));
        }
        match merge::merge(self.clash, pairs) {
            Ok(out) => {
                let warn: Vec<_> = out
                    .resolved
                    .iter()
                    .filter(|c| self.warned_keys.insert(c.key.clone()))
                    .map(|c| {
                        (
                            c.key.clone(),
                            self.name(c.first).to_owned(),
                            self.name(c.second).to_owned(),
                        )
                    })
                    .collect();
                self.counters
                    .total(Total::ClashesResolved, out.resolved.len() as u64);
                let d = PyDict::new(py);
                for e in out.entries {
                    d.set_item(e.key, e.value.0)?;
                }
                Ok((d, (!warn.is_empty()).then_some(warn)))
            }
            Err(MergeError::Compare(e)) => Err(e),
            Err(MergeError::Clash(c)) => {
                self.counters.total(Total::ClashesRaised, 1);
                Err(kvmux_error(
                    py,
                    "KvmuxParamClash",
                    (
                        c.key.clone(),
                        self.name(c.first).to_owned(),
                        self.name(c.second).to_owned(),
                        self.clash.as_str(),
                    ),
                ))
            }
        }
    }
}

/// Worker-side countdown of async saves (see `saves.rs`).
#[pyclass(frozen, name = "SaveCountdown", module = "kvmux._core")]
pub struct PySaveCountdown {
    inner: SaveCountdown,
}

#[pymethods]
impl PySaveCountdown {
    #[new]
    fn new() -> Self {
        Self {
            inner: SaveCountdown::new(),
        }
    }

    /// Record `{req_id: extra completions}` from the scheduler's metadata.
    fn expect(&self, extra: &Bound<'_, PyDict>) -> PyResult<()> {
        for (k, v) in extra.iter() {
            let id = k.cast::<PyString>()?;
            self.inner.expect(id.to_str()?, v.extract()?);
        }
        Ok(())
    }

    /// Every child's finished-sending ids of one step (repeats allowed):
    /// the set of ids finished sending now.
    fn complete<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, pyo3::types::PySet>> {
        let out = pyo3::types::PySet::empty(py)?;
        for id in ids.try_iter()? {
            let id = id?;
            let s = id.cast::<PyString>()?;
            if self.inner.complete(s.to_str()?) {
                out.add(id)?;
            }
        }
        Ok(out)
    }

    /// Completions still expected, summed over requests.
    fn pending(&self) -> u64 {
        self.inner.pending()
    }

    fn __len__(&self) -> usize {
        self.inner.len()
    }
}

/// The host tier's block index (see `block_index.rs`) behind one lock: every
/// call is a whole request's or a whole step's worth of blocks.
#[pyclass(frozen, name = "HostIndex", module = "kvmux._core")]
pub struct PyHostIndex {
    inner: Mutex<BlockIndex>,
}

/// Borrow the bytes of a list of `bytes` keys.
fn with_keys<R>(keys: &Bound<'_, PyList>, f: impl FnOnce(&[&[u8]]) -> R) -> PyResult<R> {
    let owned: Vec<Bound<'_, PyBytes>> = keys
        .iter()
        .map(|k| {
            k.cast_into::<PyBytes>().map_err(|e| {
                PyValueError::new_err(format!(
                    "block keys must be bytes (vLLM block hashes), got {}",
                    repr(e.into_inner().as_any())
                ))
            })
        })
        .collect::<PyResult<_>>()?;
    let slices: Vec<&[u8]> = owned.iter().map(|b| b.as_bytes()).collect();
    Ok(f(&slices))
}

impl PyHostIndex {
    fn lock(&self) -> MutexGuard<'_, BlockIndex> {
        // A panic while holding the lock cannot leave the index half-updated
        // in a way later calls depend on more than `check()` reports.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index locked, with `group` checked against its groups.
    fn lock_group(&self, group: usize) -> PyResult<MutexGuard<'_, BlockIndex>> {
        let ix = self.lock();
        if group >= ix.num_groups() {
            return Err(PyValueError::new_err(format!(
                "group {group} out of range: the index has {} group(s)",
                ix.num_groups()
            )));
        }
        Ok(ix)
    }
}

/// The answer of `HostIndex.servable_prefix`, in blocks.
#[pyclass(frozen, get_all, name = "ServablePrefix", module = "kvmux._core")]
pub struct PyServablePrefix {
    /// The longest prefix every group can serve (`start` when none).
    blocks: usize,
    /// Where the full-attention groups' run of ready blocks ends.
    prefix_blocks: usize,
}

impl From<ServablePrefix> for PyServablePrefix {
    fn from(p: ServablePrefix) -> Self {
        Self {
            blocks: p.blocks,
            prefix_blocks: p.prefix_blocks,
        }
    }
}

#[pymethods]
impl PyServablePrefix {
    fn __repr__(&self) -> String {
        format!(
            "ServablePrefix(blocks={}, prefix_blocks={})",
            self.blocks, self.prefix_blocks
        )
    }
}

#[pymethods]
impl PyHostIndex {
    #[new]
    #[pyo3(signature = (capacity, groups = 1))]
    fn new(capacity: usize, groups: usize) -> PyResult<Self> {
        if capacity == 0 || capacity >= u32::MAX as usize {
            return Err(PyValueError::new_err(format!(
                "host index capacity must be 1 to {} blocks, got {capacity}",
                u32::MAX - 1
            )));
        }
        if groups == 0 || groups >= u32::MAX as usize {
            return Err(PyValueError::new_err(format!(
                "host index groups must be 1 to {}, got {groups}",
                u32::MAX - 1
            )));
        }
        Ok(Self {
            inner: Mutex::new(BlockIndex::with_groups(capacity, groups)),
        })
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.lock().capacity()
    }

    #[getter]
    fn groups(&self) -> usize {
        self.lock().num_groups()
    }

    /// Number of leading blocks of `keys` whose `group` blocks are ready.
    #[pyo3(signature = (keys, group = 0))]
    fn longest_prefix(&self, keys: &Bound<'_, PyList>, group: usize) -> PyResult<usize> {
        let ix = self.lock_group(group)?;
        with_keys(keys, |k| ix.longest_prefix_in(group, k))
    }

    /// The longest prefix of `keys[:end]` every group can resume from, the
    /// first `start` blocks being on the device already; `windows[g]` is
    /// None for a full-attention group, the blocks it reads before the
    /// resume point for a windowed one.
    fn servable_prefix(
        &self,
        keys: &Bound<'_, PyList>,
        start: usize,
        end: usize,
        windows: Vec<Option<usize>>,
    ) -> PyResult<PyServablePrefix> {
        let ix = self.lock();
        if windows.len() != ix.num_groups() {
            return Err(PyValueError::new_err(format!(
                "servable_prefix needs one window per group ({}), got {}",
                ix.num_groups(),
                windows.len()
            )));
        }
        let reach: Vec<Reach> = windows
            .iter()
            .map(|w| w.map_or(Reach::Prefix, Reach::Window))
            .collect();
        with_keys(keys, |k| ix.servable_prefix(k, start, end, &reach).into())
    }

    /// Pin the slots of `group`'s blocks of `keys` for a load (all must be
    /// ready, else None).
    #[pyo3(signature = (keys, group = 0))]
    fn pin_ready(&self, keys: &Bound<'_, PyList>, group: usize) -> PyResult<Option<Vec<u32>>> {
        let mut ix = self.lock_group(group)?;
        with_keys(keys, |k| ix.pin_ready_in(group, k))
    }

    /// Reserve slots for `group`'s uncached blocks of `keys`:
    /// `(positions in keys, slots)`.
    #[pyo3(signature = (keys, group = 0))]
    fn reserve(&self, keys: &Bound<'_, PyList>, group: usize) -> PyResult<(Vec<usize>, Vec<u32>)> {
        let mut ix = self.lock_group(group)?;
        with_keys(keys, |k| ix.reserve_in(group, k).into_iter().unzip())
    }

    fn commit(&self, slots: Vec<u32>) -> usize {
        self.lock().commit(&slots)
    }

    fn abort(&self, slots: Vec<u32>) -> usize {
        self.lock().abort(&slots)
    }

    fn unpin(&self, slots: Vec<u32>) {
        self.lock().unpin(&slots)
    }

    fn clear_unpinned(&self) -> usize {
        self.lock().clear_unpinned()
    }

    fn pins(&self, slot: u32) -> u32 {
        self.lock().pins(slot)
    }

    /// Raise RuntimeError naming the first broken invariant, if any.
    fn check(&self) -> PyResult<()> {
        self.lock()
            .check()
            .map_err(pyo3::exceptions::PyRuntimeError::new_err)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let ix = self.lock();
        let (free, writing, ready, pinned) = ix.occupancy();
        let c = ix.counters();
        let d = PyDict::new(py);
        d.set_item("capacity", ix.capacity())?;
        d.set_item("free", free)?;
        d.set_item("writing", writing)?;
        d.set_item("ready", ready)?;
        d.set_item("pinned", pinned)?;
        d.set_item("stored", c.stored)?;
        d.set_item("evicted", c.evicted)?;
        d.set_item("aborted", c.aborted)?;
        Ok(d)
    }

    /// Per group: its `writing` and `ready` slots and its lifetime
    /// `stored`, `evicted` and `aborted` blocks.
    fn group_stats<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let ix = self.lock();
        (0..ix.num_groups())
            .map(|g| {
                let (writing, ready) = ix.group_occupancy(g);
                let c = ix.group_counters(g);
                let d = PyDict::new(py);
                d.set_item("writing", writing)?;
                d.set_item("ready", ready)?;
                d.set_item("stored", c.stored)?;
                d.set_item("evicted", c.evicted)?;
                d.set_item("aborted", c.aborted)?;
                Ok(d)
            })
            .collect()
    }
}

/// Chained 128-bit hashes of the full blocks of `tokens` (see `block_index.rs`).
#[pyfunction(name = "chain_token_hashes")]
fn py_chain_token_hashes<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    block_size: usize,
    seed: &[u8],
) -> Vec<Bound<'py, PyBytes>> {
    chain_token_hashes(&tokens, block_size, seed)
        .iter()
        .map(|h| PyBytes::new(py, h))
        .collect()
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<MuxCore>()?;
    m.add_class::<PySaveCountdown>()?;
    m.add_class::<PyHostIndex>()?;
    m.add_class::<PyServablePrefix>()?;
    m.add_function(wrap_pyfunction!(py_chain_token_hashes, m)?)?;
    m.add("CLASH_POLICIES", ClashPolicy::ALL.to_vec())?;
    m.add("LOAD_POLICIES", LoadPolicy::ALL.to_vec())?;
    m.add("MAX_CHILDREN", MAX_CHILDREN)?;
    m.add("CHILD_COUNTERS", CHILD_NAMES.to_vec())?;
    m.add("TOTAL_COUNTERS", TOTAL_NAMES.to_vec())?;
    Ok(())
}
