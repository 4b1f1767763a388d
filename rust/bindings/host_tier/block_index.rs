//! The host tier's index's bindings (`crate::host_tier::block_index`).

use pyo3::exceptions::{PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList, PyString};

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

use crate::bindings::{key_str, repr, str_key};
use crate::error::IndexError;
use crate::host_tier::{
    chain_token_hashes, BlockIndex, Eviction, HostTier, LoadPlan, Policy, Reach, ServablePrefix,
    SlotEvent,
};

/// The host tier's block index and per-request table (see
/// `crate::host_tier`) behind one lock: every call is a whole request's or
/// a whole step's worth of blocks, each scheduler hook one call.
#[pyclass(frozen, name = "HostIndex", module = "kvmux._core")]
pub struct PyHostIndex {
    inner: Mutex<HostTier>,
}

/// The lock's guard, seen as the index.
struct IndexGuard<'a>(MutexGuard<'a, HostTier>);

impl Deref for IndexGuard<'_> {
    type Target = BlockIndex;
    fn deref(&self) -> &BlockIndex {
        &self.0.index
    }
}

impl DerefMut for IndexGuard<'_> {
    fn deref_mut(&mut self) -> &mut BlockIndex {
        &mut self.0.index
    }
}

/// A list of `bytes` keys, checked (and any Python code a bad key's `repr`
/// runs, run) before the index is locked: no Python code ever runs under
/// the index's lock, which it could re-enter.
struct Keys<'py>(Vec<Bound<'py, PyBytes>>);

impl<'py> Keys<'py> {
    fn new(keys: &Bound<'py, PyList>) -> PyResult<Self> {
        keys.iter()
            .map(|k| {
                k.cast_into::<PyBytes>().map_err(|e| {
                    PyValueError::new_err(format!(
                        "block keys must be bytes (vLLM block hashes), got {}",
                        repr(e.into_inner().as_any())
                    ))
                })
            })
            .collect::<PyResult<_>>()
            .map(Keys)
    }

    fn slices(&self) -> Vec<&[u8]> {
        self.0.iter().map(|b| b.as_bytes()).collect()
    }
}

impl PyHostIndex {
    fn lock(&self) -> IndexGuard<'_> {
        IndexGuard(self.tier())
    }

    fn tier(&self) -> MutexGuard<'_, HostTier> {
        // A panic while holding the lock cannot leave the index half-updated
        // in a way later calls depend on more than `check()` reports.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The index locked, with `group` checked against its groups.
    fn lock_group(&self, group: usize) -> PyResult<IndexGuard<'_>> {
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

/// The answer of `HostIndex.reserve`: the slots reserved (Writing, pinned
/// until `commit` or `abort`) and the positions in the keys they are for.
#[pyclass(frozen, get_all, name = "Reservation", module = "kvmux._core")]
pub struct PyReservation {
    positions: Vec<usize>,
    slots: Vec<u32>,
    /// What the index reported since the last drain, this reservation's
    /// evictions last (as `HostIndex.take_events` gives them).
    events: Py<PyList>,
}

#[pymethods]
impl PyReservation {
    fn __repr__(&self) -> String {
        format!(
            "Reservation(positions={:?}, slots={:?})",
            self.positions, self.slots
        )
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
    /// `windows`: per group, None for full attention, else the blocks it
    /// reads before a resume point (default: every group full attention);
    /// `promote`: save the blocks other children loaded too; `eviction`
    /// (`Eviction::parse`) and `tenant_max_share`: the policy.
    #[new]
    #[pyo3(signature = (capacity, groups = 1, workers = 1, block_size = 16, windows = None, promote = true, eviction = "slru", tenant_max_share = 1.0))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        capacity: usize,
        groups: usize,
        workers: usize,
        block_size: u64,
        windows: Option<Vec<Option<usize>>>,
        promote: bool,
        eviction: &str,
        tenant_max_share: f64,
    ) -> PyResult<Self> {
        let policy = Policy {
            eviction: Eviction::parse(eviction)
                .map_err(|e| PyValueError::new_err(e.to_string()))?,
            tenant_max_share,
        };
        let index =
            BlockIndex::with_policy(capacity, groups, workers, policy).map_err(|e| match e {
                IndexError::Memory { .. } => PyMemoryError::new_err(e.to_string()),
                _ => PyValueError::new_err(e.to_string()),
            })?;
        let reach: Vec<Reach> = match windows {
            None => vec![Reach::Prefix; groups],
            Some(w) if w.len() == groups => w
                .iter()
                .map(|w| w.map_or(Reach::Prefix, Reach::Window))
                .collect(),
            Some(w) => {
                return Err(PyValueError::new_err(format!(
                    "windows needs one entry per group ({groups}), got {}",
                    w.len()
                )))
            }
        };
        Ok(Self {
            inner: Mutex::new(HostTier::new(index, block_size, reach, promote)),
        })
    }

    /// Requests the tier holds state for.
    #[getter]
    fn num_requests(&self) -> usize {
        self.tier().num_requests()
    }

    /// `get_num_new_matched_tokens` (`HostTier::lookup`): the tokens beyond
    /// `num_computed` every group can serve; what it offers is pinned.
    fn lookup(
        &self,
        req_id: &Bound<'_, PyString>,
        keys: &Bound<'_, PyList>,
        num_computed: u64,
        num_tokens: u64,
        prompt_tokens: u64,
    ) -> PyResult<u64> {
        let req_id = str_key(req_id)?;
        let keys = Keys::new(keys)?;
        Ok(self.tier().lookup(
            &req_id,
            &keys.slices(),
            num_computed,
            num_tokens,
            prompt_tokens,
        ))
    }

    /// `update_state_after_alloc` (`HostTier::allocated`): `block_ids`, the
    /// request's blocks per group. `(loaded_tokens, [blocks per group],
    /// load_errors)`, or None when vLLM allocated, in a model of several
    /// groups, blocks the lookup did not offer.
    fn allocated(
        &self,
        req_id: &Bound<'_, PyString>,
        keys: &Bound<'_, PyList>,
        block_ids: Vec<Vec<u32>>,
        num_external: u64,
    ) -> PyResult<Option<(u64, Vec<usize>, usize)>> {
        let req_id = str_key(req_id)?;
        let keys = Keys::new(keys)?;
        Ok(self
            .tier()
            .allocated(&req_id, &keys.slices(), &block_ids, num_external)
            .ok()
            .map(|a| (a.loaded_tokens, a.group_blocks, a.load_errors)))
    }

    /// The loads allocated since the last call: `(req_id, slots, blocks,
    /// group, failed)`.
    #[allow(clippy::type_complexity)]
    fn take_loads<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<Vec<(Bound<'py, PyString>, Vec<u32>, Vec<u32>, usize, bool)>> {
        let loads = self.tier().take_loads();
        loads
            .into_iter()
            .map(|l: LoadPlan| {
                Ok((
                    key_str(py, &l.req_id)?,
                    l.slots,
                    l.blocks,
                    l.group,
                    l.failed,
                ))
            })
            .collect()
    }

    /// `build_connector_meta`, per scheduled request: the blocks
    /// `(first, full)` to save now, or None.
    fn saves_due(
        &self,
        req_id: &Bound<'_, PyString>,
        num_computed: u64,
        num_scheduled: u64,
        num_keys: usize,
    ) -> PyResult<Option<(usize, usize)>> {
        let req_id = str_key(req_id)?;
        Ok(self
            .tier()
            .saves_due(&req_id, num_computed, num_scheduled, num_keys))
    }

    /// Reserve the saves of the blocks from `first` (`keys`: theirs;
    /// `block_ids`: the request's blocks per group; `tenant`: its
    /// `cache_salt`, None without one): `([(group, positions, slots, device
    /// blocks, events)], skipped per group, promoted)`.
    #[allow(clippy::type_complexity)]
    #[pyo3(signature = (req_id, keys, first, block_ids, tenant = None))]
    fn reserve_saves<'py>(
        &self,
        py: Python<'py>,
        req_id: &Bound<'py, PyString>,
        keys: &Bound<'py, PyList>,
        first: usize,
        block_ids: Vec<Vec<u32>>,
        tenant: Option<&Bound<'py, PyString>>,
    ) -> PyResult<(
        Vec<(usize, Vec<usize>, Vec<u32>, Vec<u32>, Vec<PyEvent<'py>>)>,
        Vec<usize>,
        usize,
    )> {
        let req_id = str_key(req_id)?;
        let tenant = tenant.map(str_key).transpose()?;
        let keys = Keys::new(keys)?;
        let plan = self.tier().reserve_saves(
            &req_id,
            tenant.as_deref().unwrap_or(""),
            &keys.slices(),
            first,
            &block_ids,
        );
        let groups = plan
            .groups
            .into_iter()
            .map(|g| {
                Ok((
                    g.group,
                    g.positions,
                    g.slots,
                    g.blocks,
                    events_py(py, g.events)?,
                ))
            })
            .collect::<PyResult<_>>()?;
        Ok((groups, plan.skipped, plan.promoted))
    }

    /// `request_finished` (`HostTier::finished`): `(async_save,
    /// loaded_tokens, saved_blocks, loaded per group, saved per group)`,
    /// None for a request never seen.
    #[allow(clippy::type_complexity)]
    fn finished(
        &self,
        req_id: &Bound<'_, PyString>,
    ) -> PyResult<Option<(bool, u64, usize, Vec<usize>, Vec<usize>)>> {
        let req_id = str_key(req_id)?;
        Ok(self.tier().finished(&req_id).map(|f| {
            (
                f.async_save,
                f.loaded_tokens,
                f.saved_blocks,
                f.loaded_per_group,
                f.saved_per_group,
            )
        }))
    }

    #[getter]
    fn capacity(&self) -> usize {
        self.lock().capacity()
    }

    #[getter]
    fn groups(&self) -> usize {
        self.lock().num_groups()
    }

    #[getter]
    fn workers(&self) -> usize {
        self.lock().workers()
    }

    /// Number of leading blocks of `keys` whose `group` blocks are ready.
    #[pyo3(signature = (keys, group = 0))]
    fn longest_prefix(&self, keys: &Bound<'_, PyList>, group: usize) -> PyResult<usize> {
        let keys = Keys::new(keys)?;
        let ix = self.lock_group(group)?;
        Ok(ix.longest_prefix_in(group, &keys.slices()))
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
        let keys = Keys::new(keys)?;
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
        Ok(ix
            .servable_prefix(&keys.slices(), start, end, &reach)
            .into())
    }

    /// Pin the slots of `group`'s blocks of `keys` for a load (all must be
    /// ready, else None).
    #[pyo3(signature = (keys, group = 0))]
    fn pin_ready(&self, keys: &Bound<'_, PyList>, group: usize) -> PyResult<Option<Vec<u32>>> {
        let keys = Keys::new(keys)?;
        let mut ix = self.lock_group(group)?;
        Ok(ix.pin_ready_in(group, &keys.slices()))
    }

    /// Reserve slots for `owner` (of `tenant`) to save `group`'s uncached
    /// blocks of `keys`.
    #[pyo3(signature = (keys, group = 0, owner = None, tenant = None))]
    fn reserve(
        &self,
        py: Python<'_>,
        keys: &Bound<'_, PyList>,
        group: usize,
        owner: Option<&Bound<'_, PyString>>,
        tenant: Option<&Bound<'_, PyString>>,
    ) -> PyResult<PyReservation> {
        let keys = Keys::new(keys)?;
        let owner = owner.map(str_key).transpose()?;
        let tenant = tenant.map(str_key).transpose()?;
        let (reserved, events) = self.lock_group(group)?.reserve_reporting(
            group,
            &keys.slices(),
            owner.as_deref().unwrap_or(""),
            tenant.as_deref().unwrap_or(""),
        );
        let (positions, slots) = reserved.into_iter().unzip();
        let events = PyList::new(py, events_py(py, events)?)?.unbind();
        Ok(PyReservation {
            positions,
            slots,
            events,
        })
    }

    /// `acks`: slot -> save acknowledgements, in the dict's order.
    fn ack_saves(&self, acks: &Bound<'_, PyDict>) -> PyResult<usize> {
        let acks = slot_counts(acks)?;
        Ok(self.lock().ack_saves(&acks))
    }

    /// `acks`: slot -> load acknowledgements, in the dict's order.
    fn ack_loads(&self, acks: &Bound<'_, PyDict>) -> PyResult<()> {
        let acks = slot_counts(acks)?;
        self.lock().ack_loads(&acks);
        Ok(())
    }

    fn saving(&self, owner: &Bound<'_, PyString>) -> PyResult<usize> {
        let owner = str_key(owner)?;
        Ok(self.lock().saving(&owner))
    }

    /// The events since the last call: `(kind, group, key, owner)` tuples,
    /// `kind` one of `stored`, `aborted`, `evicted`, `dropped`; `owner`
    /// None for `evicted` and `dropped`.
    fn take_events<'py>(&self, py: Python<'py>) -> PyResult<Vec<PyEvent<'py>>> {
        let events = self.lock().take_events();
        events_py(py, events)
    }

    /// The workers' report of one step in one call
    /// (`BlockIndex::workers_reported`): `failed_saves` aborted, `saved` and
    /// `loaded` (slot -> acknowledgements) counted; the events since the
    /// last drain, as `take_events` gives them.
    fn workers_reported<'py>(
        &self,
        py: Python<'py>,
        failed_saves: Vec<u32>,
        saved: &Bound<'py, PyDict>,
        loaded: &Bound<'py, PyDict>,
    ) -> PyResult<Vec<PyEvent<'py>>> {
        let (saved, loaded) = (slot_counts(saved)?, slot_counts(loaded)?);
        let events = self.lock().workers_reported(&failed_saves, &saved, &loaded);
        events_py(py, events)
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
        d.set_item("evicted_share", c.evicted_share)?;
        d.set_item("evicted_protected", c.evicted_protected)?;
        Ok(d)
    }

    /// The eviction policy's name (`"slru"`, `"lru"`) and the tenant share.
    #[getter]
    fn policy(&self) -> (&'static str, f64) {
        let p = self.lock().policy();
        (p.eviction.name(), p.tenant_max_share)
    }

    /// `(tenants holding a block, protected blocks, the protected list's
    /// target, lifetime evictions by the share rule, lifetime evictions of
    /// blocks read back)` now: O(1), for gauges read every scheduler step.
    fn policy_usage(&self) -> (usize, usize, usize, u64, u64) {
        let u = self.lock().policy_usage();
        (
            u.tenants,
            u.protected,
            u.protected_target,
            u.evicted_share,
            u.evicted_protected,
        )
    }

    /// The slots `tenant` holds (writing or ready).
    fn tenant_held(&self, tenant: &Bound<'_, PyString>) -> PyResult<usize> {
        let tenant = str_key(tenant)?;
        Ok(self.lock().tenant_held(&tenant))
    }

    /// Whether `slot` is protected (it was read back).
    fn is_protected(&self, slot: u32) -> bool {
        self.lock().is_protected(slot)
    }

    /// `(capacity, used, pinned, [used slots of each group])` now: O(groups),
    /// for gauges read every scheduler step.
    fn usage(&self) -> (usize, usize, usize, Vec<usize>) {
        let u = self.lock().usage();
        (u.capacity, u.used, u.pinned, u.group_used)
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

/// An index event as Python sees it: `(kind, group, key, owner)`.
type PyEvent<'py> = (
    &'static str,
    u32,
    Bound<'py, PyBytes>,
    Option<Bound<'py, PyString>>,
);

/// The index's events as `(kind, group, key, owner)` tuples.
fn events_py(py: Python<'_>, events: Vec<SlotEvent>) -> PyResult<Vec<PyEvent<'_>>> {
    events
        .into_iter()
        .map(|e| {
            Ok(match e {
                SlotEvent::Stored { group, key, owner } => (
                    "stored",
                    group,
                    PyBytes::new(py, &key),
                    Some(key_str(py, &owner)?),
                ),
                SlotEvent::Aborted { group, key, owner } => (
                    "aborted",
                    group,
                    PyBytes::new(py, &key),
                    Some(key_str(py, &owner)?),
                ),
                SlotEvent::Evicted { group, key } => {
                    ("evicted", group, PyBytes::new(py, &key), None)
                }
                SlotEvent::Dropped { group, key } => {
                    ("dropped", group, PyBytes::new(py, &key), None)
                }
            })
        })
        .collect()
}

/// A `{slot: count}` dict as `(slot, count)` pairs, in its order (converted
/// before the index is locked).
fn slot_counts(d: &Bound<'_, PyDict>) -> PyResult<Vec<(u32, u32)>> {
    d.iter()
        .map(|(k, v)| Ok((k.extract()?, v.extract()?)))
        .collect()
}

/// Chained 128-bit hashes of the full blocks of `tokens` (see
/// `crate::host_tier::block_index`).
#[pyfunction(name = "chain_token_hashes")]
pub(crate) fn py_chain_token_hashes<'py>(
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
