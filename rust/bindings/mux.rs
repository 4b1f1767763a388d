//! The multiplexer's bindings (`crate::mux`): the children's Python answers
//! into the core's values, the core's answers into Python objects.

use pyo3::exceptions::{PyException, PyRuntimeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{IntoPyDict, PyBytes, PyDict, PySet, PyString, PyTuple, PyType};

use std::borrow::Cow;
use std::fmt::Write;

use super::{describe, raise, repr};
use crate::breaker::{BreakerConfig, State, Transition};
use crate::error::{ChildFault, MuxError};
use crate::merge::{ClashPolicy, KeyRule, ValueEq};
use crate::mux::{
    hook, ChildFinish, Contained, FinishedParams, Mux, Params, Supplied, Want, BY_CHILD_KEY,
    EXTRA_KEY, LOCAL_KEY,
};
use crate::requests::{ChildMatch, LoadPolicy};
use crate::stats::Snapshot;

fn fault_detail(py: Python<'_>, hook: &str, fault: &ChildFault<PyErr>) -> String {
    match fault {
        ChildFault::Raised(e) | ChildFault::Interrupt(e) => describe(py, e),
        ChildFault::Malformed(why) => format!("{why}; it must return {}", hook::contract(hook)),
    }
}

// ------------------------------------------------------------ conversions

/// A Python value compared with Python's `==`.
struct PyVal<'py>(Bound<'py, PyAny>);

impl ValueEq for PyVal<'_> {
    type Error = PyErr;
    fn value_eq(&self, other: &Self) -> PyResult<bool> {
        self.0.eq(&other.0)
    }
}

/// A child's (or kvmux's own) params dict.
struct PyParams<'py>(Bound<'py, PyDict>);

impl<'py> Params for PyParams<'py> {
    type Value = PyVal<'py>;
    type Error = PyErr;
    fn entries(&self) -> Result<Vec<(String, PyVal<'py>)>, ChildFault<PyErr>> {
        let mut kv = Vec::with_capacity(self.0.len());
        for (k, v) in self.0.iter() {
            let Ok(key) = k.cast::<PyString>() else {
                return Err(ChildFault::Malformed(format!(
                    "returned a params key {} that is not a str",
                    repr(&k)
                )));
            };
            kv.push((
                str_key(key).map_err(ChildFault::Raised)?.into_owned(),
                PyVal(v),
            ));
        }
        Ok(kv)
    }
}

/// What a child raised, as a fault: an `Exception` is an error kvmux may
/// contain; any other `BaseException` (`KeyboardInterrupt`, `SystemExit`)
/// is an interrupt, passed on as it is.
fn raised(py: Python<'_>, e: PyErr) -> ChildFault<PyErr> {
    if e.is_instance_of::<PyException>(py) {
        ChildFault::Raised(e)
    } else {
        ChildFault::Interrupt(e)
    }
}

fn malformed<T>(why: String) -> Result<T, ChildFault<PyErr>> {
    Err(ChildFault::Malformed(why))
}

/// A child's `get_num_new_matched_tokens` answer.
fn to_match(ans: &Bound<'_, PyAny>) -> Result<ChildMatch, ChildFault<PyErr>> {
    let Ok(tup) = ans.cast::<PyTuple>() else {
        return malformed(format!("returned {}", repr(ans)));
    };
    if tup.len() != 2 {
        return malformed(format!("returned a tuple of {} items", tup.len()));
    }
    let toks = tup.get_item(0).map_err(ChildFault::Raised)?;
    let load_async = tup.get_item(1).map_err(ChildFault::Raised)?;
    let tokens = if toks.is_none() {
        None
    } else {
        let Ok(n) = toks.extract::<i64>() else {
            return malformed(format!("returned token count {}", repr(&toks)));
        };
        if n < 0 {
            return malformed(format!("returned a negative token count {n}"));
        }
        Some(n as u64)
    };
    let Ok(load_async) = load_async.extract::<bool>() else {
        return malformed(format!("returned load_async {}", repr(&load_async)));
    };
    Ok(ChildMatch { tokens, load_async })
}

/// A child's `request_finished(_all_groups)` answer.
fn to_finish<'py>(ans: Bound<'py, PyAny>) -> Result<ChildFinish<PyParams<'py>>, ChildFault<PyErr>> {
    let Some(tup) = ans.cast::<PyTuple>().ok().filter(|t| t.len() == 2) else {
        return malformed(format!("returned {}", repr(&ans)));
    };
    let Ok(async_save) = tup
        .get_item(0)
        .map_err(ChildFault::Raised)?
        .extract::<bool>()
    else {
        return malformed(format!("returned async_save {}", repr(&ans)));
    };
    let params = tup.get_item(1).map_err(ChildFault::Raised)?;
    let params = if params.is_none() {
        None
    } else {
        match params.cast_into::<PyDict>() {
            Ok(d) => Some(PyParams(d)),
            Err(e) => {
                return malformed(format!("returned params {}", repr(e.into_inner().as_any())))
            }
        }
    };
    Ok(ChildFinish { async_save, params })
}

/// A child's `register_finished_partial_tail` answer.
fn to_bool(ans: &Bound<'_, PyAny>) -> Result<bool, ChildFault<PyErr>> {
    ans.is_truthy().map_err(ChildFault::Raised)
}

/// One hook of every child: the bound method to call, or the constant it
/// always answers (already converted; kvmux does not call it).
struct Fanout<T> {
    calls: Vec<Option<Py<PyAny>>>,
    consts: Vec<Result<T, String>>,
}

impl<T: Clone> Fanout<T> {
    /// From `[(call?, method or constant answer)]`; `None`: every child
    /// answers `default`.
    fn new(
        plan: Option<Vec<(bool, Bound<'_, PyAny>)>>,
        n: usize,
        default: T,
        convert: impl Fn(&Bound<'_, PyAny>) -> Result<T, ChildFault<PyErr>>,
    ) -> PyResult<Self> {
        let Some(plan) = plan else {
            return Ok(Self {
                calls: (0..n).map(|_| None).collect(),
                consts: vec![Ok(default); n],
            });
        };
        if plan.len() != n {
            return Err(PyValueError::new_err(format!(
                "a hook plan needs one entry per child ({n}), got {}",
                plan.len()
            )));
        }
        let mut calls = Vec::with_capacity(n);
        let mut consts = Vec::with_capacity(n);
        for (call, obj) in plan {
            if call {
                calls.push(Some(obj.unbind()));
                consts.push(Ok(default.clone()));
            } else {
                calls.push(None);
                consts.push(convert(&obj).map_err(|f| match f {
                    ChildFault::Malformed(why) => why,
                    ChildFault::Raised(e) | ChildFault::Interrupt(e) => e.to_string(),
                }));
            }
        }
        Ok(Self { calls, consts })
    }

    /// Child `i`'s answer: its constant, or `call(method)` converted.
    fn answer<'py>(
        &self,
        py: Python<'py>,
        i: usize,
        call: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
        convert: impl FnOnce(Bound<'py, PyAny>) -> Result<T, ChildFault<PyErr>>,
    ) -> Result<T, ChildFault<PyErr>> {
        match &self.calls[i] {
            Some(f) => convert(call(f.bind(py)).map_err(|e| raised(py, e))?),
            None => self.consts[i].clone().map_err(ChildFault::Malformed),
        }
    }
}

type Plan<'py> = Option<Vec<(bool, Bound<'py, PyAny>)>>;

/// One hook of every child whose answer kvmux hands on as a Python object
/// (metadata, stats): the children to call, and every child's constant.
struct PyFanout {
    calls: Vec<(usize, Py<PyAny>)>,
    consts: Vec<Py<PyAny>>,
}

impl PyFanout {
    fn new(py: Python<'_>, plan: Plan<'_>, n: usize) -> PyResult<Self> {
        let plan =
            plan.unwrap_or_else(|| (0..n).map(|_| (false, py.None().into_bound(py))).collect());
        if plan.len() != n {
            return Err(PyValueError::new_err(format!(
                "a hook plan needs one entry per child ({n}), got {}",
                plan.len()
            )));
        }
        let mut calls = Vec::new();
        let mut consts = Vec::with_capacity(n);
        for (i, (call, obj)) in plan.into_iter().enumerate() {
            if call {
                calls.push((i, obj.unbind()));
                consts.push(py.None());
            } else {
                consts.push(obj.unbind());
            }
        }
        Ok(Self { calls, consts })
    }

    /// Every child's answer: the constants, and `call(method)` for the
    /// children that must be called (a failure names the child).
    fn answers<'py>(
        &self,
        py: Python<'py>,
        call: impl Fn(&Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
    ) -> Result<Vec<Bound<'py, PyAny>>, (usize, PyErr)> {
        let mut out: Vec<Bound<'py, PyAny>> =
            self.consts.iter().map(|c| c.bind(py).clone()).collect();
        for (i, f) in &self.calls {
            out[*i] = call(f.bind(py)).map_err(|e| (*i, e))?;
        }
        Ok(out)
    }
}

/// The Python objects the per-step hooks hand back to vLLM, and how often
/// the counters are reported.
struct Glue {
    /// `KvmuxMetadata(children, saves, loads, load_blocks)`.
    metadata: Py<PyAny>,
    /// `KvmuxWorkerMetadata`, the type the workers' metadata must have.
    worker_metadata: Py<PyType>,
    /// `build_child_stats(names, child_stats, counters)`.
    stats: Py<PyAny>,
    stats_every: std::time::Duration,
    names: Py<PyTuple>,
}

// --------------------------------------------------------------- the mux

/// The multiplexer (see `mux.rs`), with its children's hooks.
#[pyclass(frozen, name = "Mux", module = "kvmux._core")]
pub struct PyMux {
    core: Mux,
    logger: Py<PyAny>,
    lookup: Fanout<ChildMatch>,
    alloc: Vec<Option<Py<PyAny>>>,
    finished: Fanout<bool>,
    finished_all_groups: Fanout<bool>,
    partial_tail: Fanout<bool>,
    /// Child i takes every KV cache group (`request_finished_all_groups`).
    hma: Vec<bool>,
    all_hma: bool,
    /// How to run a multi-group model with non-HMA children (for the error).
    hma_fix: String,
    on_new_request: PyFanout,
    build_meta: PyFanout,
    update_output: PyFanout,
    child_stats: PyFanout,
    /// None on a worker: its Mux only counts.
    glue: Option<Glue>,
}

impl PyMux {
    fn glue(&self, hook: &str) -> PyResult<&Glue> {
        self.glue.as_ref().ok_or_else(|| {
            PyRuntimeError::new_err(format!(
                "kvmux: {hook} is a scheduler-side hook; this multiplexer was built without \
                 the scheduler's glue"
            ))
        })
    }

    fn child_error(&self, py: Python<'_>, hook: &'static str, (i, e): (usize, PyErr)) -> PyErr {
        self.error(py, MuxError::child(i, hook, raised(py, e)))
    }

    /// The workers' failed loads (`invalid_block_ids`, `failed_recving`):
    /// the tokens vLLM recomputes stop counting as loaded. Returns how many
    /// requests lost tokens.
    fn load_errors(
        &self,
        invalid_block_ids: Option<std::collections::HashSet<u32>>,
        failed_recving: Option<std::collections::HashSet<String>>,
    ) -> usize {
        let invalid = invalid_block_ids.unwrap_or_default();
        let failed = failed_recving.unwrap_or_default();
        if invalid.is_empty() && failed.is_empty() {
            return 0;
        }
        self.core
            .load_errors(|b| invalid.contains(&b), |r| failed.contains(r))
    }

    /// The step's completions go by the core first ([`Mux::reported`]);
    /// those it holds back are taken out of what vLLM reads (a held receive
    /// from `failed_recving` too).
    fn hold_completions(&self, py: Python<'_>, output: &Bound<'_, PyAny>) -> PyResult<()> {
        let recv_key = intern!(py, "finished_recving");
        let send_key = intern!(py, "finished_sending");
        let ids = |key: &Bound<'_, PyString>| -> PyResult<Vec<String>> {
            let v = output.getattr(key)?;
            if v.is_none() {
                return Ok(Vec::new());
            }
            // Keyed as the core keys them (`str_key`); a non-str id was
            // never tracked: skipped.
            Ok(v.try_iter()?
                .filter_map(|id| {
                    let id = id.ok()?.cast_into::<PyString>().ok()?;
                    str_key(&id).ok().map(Cow::into_owned)
                })
                .collect())
        };
        let held = self.core.reported(&ids(recv_key)?, &ids(send_key)?);
        let keys = [
            (recv_key, &held.recving),
            (intern!(py, "failed_recving"), &held.recving),
            (send_key, &held.sending),
        ];
        for (key, gone) in keys {
            if gone.is_empty() {
                continue;
            }
            let Ok(v) = output.getattr(key) else {
                continue; // a vLLM without failed_recving
            };
            if v.is_none() {
                continue;
            }
            let kept = PySet::empty(py)?;
            for id in v.try_iter()? {
                let id = id?;
                let is_held = id
                    .cast::<PyString>()
                    .ok()
                    .and_then(|s| str_key(s).ok().map(|k| gone.iter().any(|g| *g == *k)))
                    .unwrap_or(false);
                if !is_held {
                    kept.add(id)?;
                }
            }
            output.setattr(key, kept)?;
        }
        Ok(())
    }

    /// What the workers must be told with the next step's metadata:
    /// `(saves: request id -> (bit set of the saving children, completions
    /// needed), loads: request id -> bit set of the async loaders,
    /// load_blocks: request id -> the blocks a load with a deadline
    /// writes)`, each None when empty.
    #[allow(clippy::type_complexity)]
    fn take_outbox<'py>(
        &self,
        py: Python<'py>,
    ) -> PyResult<(
        Option<Bound<'py, PyDict>>,
        Option<Bound<'py, PyDict>>,
        Option<Bound<'py, PyDict>>,
    )> {
        let out = self.core.take_outbox();
        // The usual step: nothing to tell the workers, no dict built.
        if out.is_empty() {
            return Ok((None, None, None));
        }
        // Keyed by the requests' own ids (the core's keys turned back:
        // `key_str`), as the workers' children report them.
        fn by_id<'py, V: IntoPyObject<'py>>(
            py: Python<'py>,
            m: impl IntoIterator<Item = (String, V)>,
        ) -> PyResult<Option<Bound<'py, PyDict>>> {
            let d = PyDict::new(py);
            for (req, v) in m {
                d.set_item(key_str(py, &req)?, v)?;
            }
            Ok((!d.is_empty()).then_some(d))
        }
        let saves = by_id(py, out.saves)?;
        let loads = by_id(py, out.loads)?;
        let load_blocks = by_id(py, out.load_blocks)?;
        Ok((saves, loads, load_blocks))
    }

    fn error(&self, py: Python<'_>, e: MuxError<PyErr>) -> PyErr {
        match e {
            MuxError::Child {
                fault: ChildFault::Interrupt(e),
                ..
            } => e,
            MuxError::Child { child, hook, fault } => {
                let detail = fault_detail(py, hook, &fault);
                let err = raise(
                    py,
                    |t| &t.child,
                    (self.core.name(child).to_owned(), hook, detail),
                );
                if let ChildFault::Raised(cause) = fault {
                    err.set_cause(py, Some(cause));
                }
                err
            }
            MuxError::ParamClash {
                key,
                first,
                second,
                policy,
            } => raise(
                py,
                |t| &t.clash,
                (
                    key,
                    self.core.name(first).to_owned(),
                    self.core.name(second).to_owned(),
                    policy,
                ),
            ),
            MuxError::Host(e) => e,
            MuxError::TooManyGroups {
                request,
                groups,
                children,
            } => {
                // Python's reprs, as in every other kvmux message.
                let names: Vec<String> = children
                    .iter()
                    .map(|&i| format!("'{}'", self.core.name(i)))
                    .collect();
                raise(
                    py,
                    |t| &t.config,
                    (format!(
                        "request '{request}' holds KV in {groups} cache groups but children \
                         [{}] do not support the hybrid KV cache manager and can be given \
                         only one (they would lose the others); {}, or use only HMA-capable \
                         children",
                        names.join(", "),
                        self.hma_fix
                    ),),
                )
            }
            MuxError::Config(msg) => PyValueError::new_err(msg),
        }
    }

    fn log_contained(&self, py: Python<'_>, req_id: &str, contained: &[Contained<PyErr>]) {
        for c in contained {
            if c.hook == hook::LOOKUP {
                self.log_lookup_error(py, req_id, c);
                continue;
            }
            let level = if c.first { 30 } else { 10 };
            let suffix = if c.first {
                " (warned once per child; later ones at debug level)"
            } else {
                ""
            };
            let _ = self.logger.bind(py).call_method1(
                intern!(py, "log"),
                (
                    level,
                    "kvmux: child %r failed in %s for request %r, which it never took part in \
                     (it ended before the child looked it up); contained: no async save, no \
                     params from this child, counted in its contained_errors%s. Cause: %s",
                    self.core.name(c.child),
                    c.hook,
                    req_id,
                    suffix,
                    fault_detail(py, c.hook, &c.fault),
                ),
            );
        }
    }

    fn log_lookup_error(&self, py: Python<'_>, req_id: &str, c: &Contained<PyErr>) {
        let (level, suffix) = if c.first {
            (30, " (warned once per child; later ones at debug level)")
        } else {
            (10, "")
        };
        let _ = self.logger.bind(py).call_method1(
            intern!(py, "log"),
            (
                level,
                "kvmux: child %r failed in %s for request %r; contained as a miss (the \
                 request goes on without it), counted in its lookup_errors and its \
                 breaker%s. Cause: %s",
                self.core.name(c.child),
                c.hook,
                req_id,
                suffix,
                fault_detail(py, c.hook, &c.fault),
            ),
        );
    }

    /// Each breaker transition, logged once: opening as a warning, the
    /// probe and closing as info.
    fn log_transitions(&self, py: Python<'_>, transitions: Vec<Transition>) {
        let logger = self.logger.bind(py);
        for t in transitions {
            let name = self.core.name(t.child);
            let _ = match t.to {
                State::Open => logger.call_method1(
                    intern!(py, "warning"),
                    (
                        "kvmux: breaker of child %r opened after %d failed lookup(s) \
                         (deadline missed or raised); it is not asked for %.1f s, then one \
                         request probes it (breaker_failures, breaker_cooldown_ms)",
                        name,
                        t.failures,
                        t.cooldown.map_or(0.0, |d| d.as_secs_f64()),
                    ),
                ),
                State::HalfOpen => logger.call_method1(
                    intern!(py, "info"),
                    (
                        "kvmux: breaker of child %r half open: request %r probes it",
                        name,
                        t.probe.unwrap_or_default(),
                    ),
                ),
                State::Closed => logger.call_method1(
                    intern!(py, "info"),
                    (
                        "kvmux: breaker of child %r closed: its probe was answered; it is \
                         asked again",
                        name,
                    ),
                ),
            };
        }
    }

    /// A finish hook: child `i` is called with `route(i)`, the hook it gets
    /// and the block ids to pass it.
    fn finish<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        route: impl Fn(usize) -> (&'static str, Bound<'py, PyAny>),
    ) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        let rid = request_id(request)?;
        let req_id = &*str_key(&rid)?;
        let asked_params = request
            .getattr(intern!(py, "kv_transfer_params"))
            .ok()
            .and_then(|p| p.cast_into::<PyDict>().ok())
            .filter(|d| !d.is_empty());
        let want = match &asked_params {
            Some(d) => Want {
                extra: d.contains(EXTRA_KEY)?,
                by_child: d.contains(BY_CHILD_KEY)?,
            },
            None => Want::default(),
        };
        // Read only when two sources return one key.
        let asked = |key: &str| {
            asked_params
                .as_ref()
                .is_some_and(|d| d.contains(key).unwrap_or(false))
        };
        let own = |s: &Supplied| {
            let d = PyDict::new(py);
            if s.want.extra {
                d.set_item(EXTRA_KEY, s.extra)?;
            }
            if s.want.by_child {
                let split = PyDict::new(py);
                for (i, n) in s.by_child.iter().enumerate() {
                    split.set_item(self.core.name(i), n)?;
                }
                split.set_item(LOCAL_KEY, s.local)?;
                d.set_item(BY_CHILD_KEY, split)?;
            }
            Ok(PyParams(d))
        };
        let call = |i: usize| {
            let (hook, blocks) = route(i);
            let fan = if hook == hook::FINISHED {
                &self.finished
            } else {
                &self.finished_all_groups
            };
            match &fan.calls[i] {
                Some(f) => to_finish(
                    f.bind(py)
                        .call1((request, blocks))
                        .map_err(|e| raised(py, e))?,
                ),
                None => fan.consts[i]
                    .clone()
                    .map(|async_save| ChildFinish {
                        async_save,
                        params: None,
                    })
                    .map_err(ChildFault::Malformed),
            }
        };
        let done = self
            .core
            .finish(req_id, |i| route(i).0, want, asked, own, call)
            .map_err(|e| self.error(py, e))?;
        self.log_contained(py, req_id, &done.contained);
        for c in &done.new_clashes {
            let how = match c.rule {
                KeyRule::Policy => format!(
                    "clash_policy {:?} keeps one",
                    self.core.clash_policy().as_str()
                ),
                KeyRule::PerSource => "the request asked for it, so it is answered with \
                                       each child's value, keyed by child name"
                    .to_owned(),
                KeyRule::Own(_) => "it is kvmux's own key, so kvmux's value is kept".to_owned(),
            };
            let _ = self.logger.bind(py).call_method1(
                intern!(py, "warning"),
                (
                    "kvmux: %r and %r both return kv_transfer_params key %r; %s (warned once \
                     per key)",
                    self.core.name(c.first),
                    self.core.name(c.second),
                    &c.key,
                    how,
                ),
            );
        }
        let params = match done.params {
            None => None,
            Some(FinishedParams::Source(p)) => Some(p.0),
            Some(FinishedParams::Merged(entries)) => {
                let d = PyDict::new(py);
                for e in entries {
                    let key = key_str(py, &e.key)?;
                    if e.others.is_empty() {
                        d.set_item(key, e.value.0)?;
                        continue;
                    }
                    let per = PyDict::new(py);
                    per.set_item(self.core.name(e.source), e.value.0)?;
                    for (i, v) in e.others {
                        per.set_item(self.core.name(i), v.0)?;
                    }
                    d.set_item(key, per)?;
                }
                Some(d)
            }
        };
        Ok((done.async_save, params))
    }

    fn complete<'py>(
        &self,
        py: Python<'py>,
        per_child: &Bound<'py, PyAny>,
        done: impl Fn(usize, &str) -> bool,
    ) -> PyResult<Bound<'py, PySet>> {
        let out = PySet::empty(py)?;
        for (i, ids) in per_child.try_iter()?.enumerate() {
            let ids = ids?;
            if ids.is_none() {
                continue;
            }
            for id in ids.try_iter()? {
                let id = id?.cast_into::<PyString>()?;
                if done(i, &str_key(&id)?) {
                    out.add(id)?;
                }
            }
        }
        Ok(out)
    }

    /// Worker side: loads past their child's load deadline are failed (see
    /// `Mux::expire_loads`): each request reported now is added to
    /// `finished` (and `failed`).
    fn expire_loads(
        &self,
        finished: &Bound<'_, PySet>,
        failed: Option<&Bound<'_, PySet>>,
    ) -> PyResult<()> {
        let mut err = None;
        self.core.expire_loads(std::time::Instant::now(), |id| {
            let r = finished
                .add(id)
                .and_then(|()| failed.map_or(Ok(()), |f| f.add(id)));
            if let Err(e) = r {
                err.get_or_insert(e);
            }
        });
        err.map_or(Ok(()), Err)
    }

    /// Counters as a dict; `sparse` drops zeros and folds the clash counters
    /// into `{"clashes": {policy: n}}`.
    fn counters_dict<'py>(
        &self,
        py: Python<'py>,
        snap: &Snapshot,
        sparse: bool,
    ) -> PyResult<Bound<'py, PyDict>> {
        let report = snap.report(sparse, self.core.clash_policy().as_str());
        let out = PyDict::new(py);
        let children = PyDict::new(py);
        for (i, kv) in report.children {
            children.set_item(self.core.name(i), kv.into_py_dict(py)?)?;
        }
        if !children.is_empty() || !sparse {
            out.set_item("children", children)?;
        }
        for (k, v) in report.totals {
            out.set_item(k, v)?;
        }
        if let Some((policy, n)) = report.clashes {
            out.set_item("clashes", [(policy, n)].into_py_dict(py)?)?;
        }
        Ok(out)
    }
}

/// Starts the key of a str that is not valid UTF-8 (see [`str_key`]); a
/// noncharacter, so no id vLLM makes starts with it.
const ESCAPE: char = '\u{FDD0}';

/// A Python str as a Rust key: the str itself when it is valid UTF-8 (every
/// id vLLM makes), else (a lone surrogate, from a client's request id) the
/// escape followed by the hex of its `surrogatepass` bytes. Keys are opaque:
/// any str is one, and distinct strs are distinct keys (a valid str that
/// starts with the escape is escaped too).
fn str_key<'a>(s: &'a Bound<'_, PyString>) -> PyResult<Cow<'a, str>> {
    match s.to_str() {
        Ok(k) if !k.starts_with(ESCAPE) => Ok(Cow::Borrowed(k)),
        _ => {
            let raw = s.call_method1(intern!(s.py(), "encode"), ("utf-8", "surrogatepass"))?;
            let bytes = raw.cast::<PyBytes>()?.as_bytes();
            let mut out = String::with_capacity(ESCAPE.len_utf8() + 2 * bytes.len());
            out.push(ESCAPE);
            for b in bytes {
                let _ = write!(out, "{b:02x}");
            }
            Ok(Cow::Owned(out))
        }
    }
}

/// The Python str whose key is `key` (the inverse of [`str_key`]).
fn key_str<'py>(py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyString>> {
    let Some(hex) = key.strip_prefix(ESCAPE) else {
        return Ok(PyString::new(py, key));
    };
    let bytes: Vec<u8> = (0..hex.len() / 2)
        .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap_or(0))
        .collect();
    let s =
        PyBytes::new(py, &bytes).call_method1(intern!(py, "decode"), ("utf-8", "surrogatepass"))?;
    Ok(s.cast_into::<PyString>()?)
}

/// `request.request_id`, as a Python str (its key: [`str_key`]).
fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let id = request.getattr(intern!(request.py(), "request_id"))?;
    Ok(id.cast_into::<PyString>()?)
}

#[pymethods]
impl PyMux {
    /// `hooks`: hook name -> one `(call, method or constant answer)` per
    /// child (see `kvmux.children`); a hook left out is answered by every
    /// child with vLLM's default. `hma[i]`: child i supports the hybrid KV
    /// cache manager.
    #[new]
    #[pyo3(signature = (names, clash_policy, load_policy, block_size, hooks, hma, logger, hma_fix, glue = None, lookup_timeouts_ms = None, breakers = None, load_timeouts_ms = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        names: Vec<String>,
        clash_policy: &str,
        load_policy: &str,
        block_size: u64,
        hooks: &Bound<'_, PyDict>,
        hma: Vec<bool>,
        logger: Bound<'_, PyAny>,
        hma_fix: String,
        glue: Option<&Bound<'_, PyDict>>,
        lookup_timeouts_ms: Option<Vec<Option<f64>>>,
        breakers: Option<Vec<Option<(u32, f64, f64)>>>,
        load_timeouts_ms: Option<Vec<Option<f64>>>,
    ) -> PyResult<Self> {
        let n = names.len();
        let glue = glue
            .map(|g| -> PyResult<Glue> {
                let item = |k: &str| {
                    g.get_item(k)?
                        .ok_or_else(|| PyValueError::new_err(format!("glue needs {k:?}")))
                };
                let every_s: f64 = item("stats_every_s")?.extract()?;
                Ok(Glue {
                    metadata: item("metadata")?.unbind(),
                    worker_metadata: item("worker_metadata")?.cast_into::<PyType>()?.unbind(),
                    stats: item("stats")?.unbind(),
                    stats_every: std::time::Duration::try_from_secs_f64(every_s).map_err(|_| {
                        PyValueError::new_err(format!("stats_every_s must be >= 0, got {every_s}"))
                    })?,
                    names: PyTuple::new(py, &names)?.unbind(),
                })
            })
            .transpose()?;
        let clash: ClashPolicy = clash_policy.parse().map_err(PyValueError::new_err)?;
        let load: LoadPolicy = load_policy.parse().map_err(PyValueError::new_err)?;
        let ms = |what: &str, ms: f64| {
            std::time::Duration::try_from_secs_f64(ms / 1000.0).map_err(|_| {
                PyValueError::new_err(format!("{what} must be >= 0 milliseconds, got {ms}"))
            })
        };
        let deadlines = lookup_timeouts_ms
            .unwrap_or_else(|| vec![None; n])
            .into_iter()
            .map(|t| t.map(|t| ms("lookup_timeouts_ms", t)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let load_deadlines = load_timeouts_ms
            .unwrap_or_else(|| vec![None; n])
            .into_iter()
            .map(|t| t.map(|t| ms("load_timeouts_ms", t)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let breakers = breakers
            .unwrap_or_else(|| vec![None; n])
            .into_iter()
            .map(|b| {
                b.map(|(failures, cooldown, max)| -> PyResult<BreakerConfig> {
                    Ok(BreakerConfig {
                        failures,
                        cooldown: ms("breaker_cooldown_ms", cooldown)?,
                        max_cooldown: ms("breaker_max_cooldown_ms", max)?,
                    })
                })
                .transpose()
            })
            .collect::<PyResult<Vec<_>>>()?;
        let core = Mux::new(names, clash, load, block_size)
            .and_then(|m| m.with_lookup_deadlines(deadlines))
            .and_then(|m| m.with_breakers(breakers))
            .and_then(|m| m.with_load_deadlines(load_deadlines))
            .map_err(|e: MuxError<PyErr>| PyValueError::new_err(e.to_string()))?;
        if hma.len() != n {
            return Err(PyValueError::new_err(format!(
                "hma needs one flag per child ({n}), got {}",
                hma.len()
            )));
        }
        let plan = |name: &str| -> PyResult<Plan<'_>> {
            hooks.get_item(name)?.map(|p| p.extract()).transpose()
        };
        let finish_const = |a: &Bound<'_, PyAny>| {
            to_finish(a.clone()).and_then(|f| {
                if f.params.is_some() {
                    malformed("returned constant params".into())
                } else {
                    Ok(f.async_save)
                }
            })
        };
        let no_match = ChildMatch {
            tokens: Some(0),
            load_async: false,
        };
        let alloc = match plan(hook::ALLOC)? {
            None => (0..n).map(|_| None).collect(),
            Some(p) if p.len() == n => p
                .into_iter()
                .map(|(call, f)| call.then(|| f.unbind()))
                .collect(),
            Some(p) => {
                return Err(PyValueError::new_err(format!(
                    "a hook plan needs one entry per child ({n}), got {}",
                    p.len()
                )))
            }
        };
        Ok(Self {
            lookup: Fanout::new(plan(hook::LOOKUP)?, n, no_match, to_match)?,
            alloc,
            finished: Fanout::new(plan(hook::FINISHED)?, n, false, finish_const)?,
            finished_all_groups: Fanout::new(
                plan(hook::FINISHED_ALL_GROUPS)?,
                n,
                false,
                finish_const,
            )?,
            partial_tail: Fanout::new(plan(hook::PARTIAL_TAIL)?, n, false, to_bool)?,
            all_hma: hma.iter().all(|&h| h),
            hma,
            hma_fix,
            on_new_request: PyFanout::new(py, plan(hook::ON_NEW_REQUEST)?, n)?,
            build_meta: PyFanout::new(py, plan(hook::BUILD_META)?, n)?,
            update_output: PyFanout::new(py, plan(hook::UPDATE_OUTPUT)?, n)?,
            child_stats: PyFanout::new(py, plan(hook::STATS)?, n)?,
            glue,
            logger: logger.unbind(),
            core,
        })
    }

    /// vLLM's `get_num_new_matched_tokens`: every child asked (those whose
    /// answer is constant are not called), the loading child chosen by the
    /// load policy and remembered. A child failing raises `KvmuxChildError`
    /// naming it, and the request's state is dropped; but a child with a
    /// breaker that raises is a miss for the request, logged (once loudly)
    /// and counted. Breaker transitions are logged here, once each.
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: u64,
    ) -> PyResult<(Option<u64>, bool)> {
        let rid = request_id(request)?;
        let req_id = &*str_key(&rid)?;
        let got = self
            .core
            .lookup(req_id, num_computed_tokens, |i, computed| {
                self.lookup
                    .answer(py, i, |f| f.call1((request, computed)), |a| to_match(&a))
            })
            .map_err(|e| self.error(py, e))?;
        if !got.contained.is_empty() {
            self.log_contained(py, req_id, &got.contained);
        }
        let transitions = self.core.take_breaker_transitions();
        if !transitions.is_empty() {
            self.log_transitions(py, transitions);
        }
        Ok((got.tokens, got.load_async))
    }

    /// vLLM's `update_state_after_alloc`: the chosen child gets
    /// `num_external_tokens`, the others 0; every child gets the blocks.
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_external_tokens: u64,
    ) -> PyResult<()> {
        let rid = request_id(request)?;
        let load_blocks = || -> PyResult<Vec<u32>> {
            if blocks.is_none() {
                return Ok(Vec::new());
            }
            let groups = blocks.call_method0(intern!(py, "get_block_ids"))?;
            // Block-level load errors exist for single-group layouts only
            // (vLLM refuses them otherwise); multi-group ones come as
            // failed_recving, which needs no blocks.
            if groups.len()? != 1 {
                return Ok(Vec::new());
            }
            groups.get_item(0)?.extract()
        };
        self.core
            .allocated(
                &str_key(&rid)?,
                num_external_tokens,
                load_blocks,
                |i, n| match &self.alloc[i] {
                    Some(f) => f
                        .bind(py)
                        .call1((request, blocks, n))
                        .map(drop)
                        .map_err(|e| raised(py, e)),
                    None => Ok(()),
                },
            )
            .map_err(|e| self.error(py, e))?;
        Ok(())
    }

    /// vLLM's `request_finished`: every child's, with the same blocks.
    fn request_finished<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block_ids: Bound<'py, PyAny>,
    ) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        self.finish(py, request, |_| (hook::FINISHED, block_ids.clone()))
    }

    /// vLLM's `request_finished_all_groups`: a child with HMA support gets
    /// every group, a child without gets `request_finished` with the one
    /// group's blocks; several groups with such a child raise
    /// `KvmuxConfigError` naming them.
    fn request_finished_all_groups<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block_ids: Bound<'py, PyAny>,
    ) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        if self.all_hma {
            return self.finish(py, request, |_| {
                (hook::FINISHED_ALL_GROUPS, block_ids.clone())
            });
        }
        let groups = block_ids.len()?;
        if groups != 1 {
            let rid = request_id(request)?;
            let req_id = &*str_key(&rid)?;
            self.core.forget(req_id);
            let children = (0..self.hma.len()).filter(|&i| !self.hma[i]).collect();
            return Err(self.error(
                py,
                MuxError::TooManyGroups {
                    request: req_id.to_owned(),
                    groups,
                    children,
                },
            ));
        }
        let group0 = block_ids.get_item(0)?;
        self.finish(py, request, |i| {
            if self.hma[i] {
                (hook::FINISHED_ALL_GROUPS, block_ids.clone())
            } else {
                (hook::FINISHED, group0.clone())
            }
        })
    }

    /// vLLM's `register_finished_partial_tail`: true when any child keeps
    /// the request's blocks for a partial tail (failures contained as in a
    /// finish).
    fn register_finished_partial_tail(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        block_ids: &Bound<'_, PyAny>,
        partial_tail_offloads: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let rid = request_id(request)?;
        let req_id = &*str_key(&rid)?;
        let (keep, contained) = self
            .core
            .partial_tail(req_id, |i| {
                self.partial_tail.answer(
                    py,
                    i,
                    |f| f.call1((request, block_ids, partial_tail_offloads)),
                    |a| to_bool(&a),
                )
            })
            .map_err(|e| self.error(py, e))?;
        self.log_contained(py, req_id, &contained);
        Ok(keep)
    }

    /// vLLM's `on_new_request`: the children whose hook does something hear
    /// of the request.
    fn on_new_request(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        for (i, f) in &self.on_new_request.calls {
            f.bind(py)
                .call1((request,))
                .map_err(|e| self.child_error(py, hook::ON_NEW_REQUEST, (*i, e)))?;
        }
        Ok(())
    }

    /// vLLM's `build_connector_meta`: every child's metadata, in config
    /// order, and what the workers must know of the requests that finished
    /// since the last step (taken only once every child has answered).
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let glue = self.glue(hook::BUILD_META)?;
        let metas = self
            .build_meta
            .answers(py, |f| f.call1((scheduler_output,)))
            .map_err(|e| self.child_error(py, hook::BUILD_META, e))?;
        let (saves, loads, load_blocks) = self.take_outbox(py)?;
        glue.metadata
            .bind(py)
            .call1((PyTuple::new(py, metas)?, saves, loads, load_blocks))
    }

    /// vLLM's `update_connector_output`: loads the workers report failed
    /// (`invalid_block_ids`, `failed_recving`) stop counting as loaded; each
    /// child whose hook does something sees its own slice of the workers'
    /// metadata (restored afterwards).
    fn update_connector_output(
        &self,
        py: Python<'_>,
        connector_output: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let output = connector_output;
        let glue = self.glue(hook::UPDATE_OUTPUT)?;
        if self.core.watching() {
            let invalid: Option<std::collections::HashSet<u32>> = output
                .getattr(intern!(py, "invalid_block_ids"))?
                .extract()?;
            let failed: Option<std::collections::HashSet<String>> =
                match output.getattr(intern!(py, "failed_recving")) {
                    Ok(f) => f.extract()?,
                    Err(_) => None, // a vLLM without failed_recving
                };
            self.load_errors(invalid, failed);
        }
        if self.core.tracking_loads() {
            self.hold_completions(py, output)?;
        }
        let key = intern!(py, "kv_connector_worker_meta");
        let worker_meta = output.getattr(key)?;
        if !worker_meta.is_none() && !worker_meta.is_instance(glue.worker_metadata.bind(py))? {
            return Err(pyo3::exceptions::PyTypeError::new_err(format!(
                "kvmux got worker metadata of type {}; the workers must run the same \
                 KvmuxConnector configuration",
                worker_meta.get_type().name()?
            )));
        }
        if self.update_output.calls.is_empty() {
            return Ok(());
        }
        let slices = if worker_meta.is_none() {
            None
        } else {
            Some(worker_meta.getattr(intern!(py, "children"))?)
        };
        let told = (|| -> PyResult<()> {
            for (i, f) in &self.update_output.calls {
                if let Some(s) = &slices {
                    output.setattr(key, s.get_item(*i)?)?;
                }
                f.bind(py)
                    .call1((output,))
                    .map_err(|e| self.child_error(py, hook::UPDATE_OUTPUT, (*i, e)))?;
            }
            Ok(())
        })();
        if slices.is_some() {
            output.setattr(key, &worker_meta)?;
        }
        told
    }

    /// vLLM's `get_kv_connector_stats` (every step): the children's stats
    /// and kvmux's counters, at most once per `stats_every_s` and whenever
    /// no request is live (the counts wait in the core until taken); None
    /// when there is nothing to report.
    fn get_kv_connector_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let glue = self.glue(hook::STATS)?;
        let stats = self
            .child_stats
            .answers(py, |f| f.call0())
            .map_err(|e| self.child_error(py, hook::STATS, e))?;
        let mut counters = match self.core.take_interval_every(glue.stats_every) {
            Some(delta) if !delta.is_zero() => Some(self.counters_dict(py, &delta, true)?),
            _ => None,
        };
        // A breaker changed state: its gauge is reported now.
        if let Some(states) = self.core.take_breaker_changes() {
            let gauge = PyDict::new(py);
            for (i, state) in states.into_iter().enumerate() {
                if let Some(state) = state {
                    gauge.set_item(self.core.name(i), state.gauge())?;
                }
            }
            let out = counters.get_or_insert_with(|| PyDict::new(py));
            out.set_item(intern!(py, "breaker_state"), gauge)?;
        }
        if counters.is_none() && stats.iter().all(|s| s.is_none()) {
            return Ok(None);
        }
        let built =
            glue.stats
                .bind(py)
                .call1((glue.names.bind(py), PyTuple::new(py, stats)?, counters))?;
        Ok((!built.is_none()).then_some(built))
    }

    /// Requests aborted mid-load beside an async save whose last
    /// completion vLLM still waits for.
    fn joined_requests(&self) -> usize {
        self.core.joined_requests()
    }

    /// The child chosen to load a request, if any.
    fn chosen(&self, req_id: &Bound<'_, PyString>) -> PyResult<Option<usize>> {
        Ok(self.core.chosen(&str_key(req_id)?))
    }

    /// vLLM's hits-by-source split of a request's `num_external_tokens`
    /// (`Mux::hit_sources`): `split(i, span)` is child i's own split of its
    /// span as `(source, tokens)` pairs, or None; `own[i]` its own source.
    fn hit_sources(
        &self,
        req_id: &Bound<'_, PyString>,
        num_external_tokens: u64,
        split: &Bound<'_, PyAny>,
        own: Vec<String>,
    ) -> PyResult<Vec<(String, u64)>> {
        self.core.hit_sources(
            &str_key(req_id)?,
            num_external_tokens,
            |i, span| split.call1((i, span))?.extract(),
            |i| own.get(i).cloned().unwrap_or_default(),
        )
    }

    /// Worker side: the completions the scheduler side announced in its
    /// metadata (`saves`: request id -> (bit set of the saving children,
    /// completions needed); `loads`: request id -> bit set of the children
    /// loading it asynchronously).
    /// `load_blocks`: request id -> the blocks of a load by a child with a
    /// load deadline, reported as load errors if it misses it (pass them
    /// only where vLLM has no failed receives).
    #[pyo3(signature = (saves = None, loads = None, load_blocks = None))]
    fn expect<'py>(
        &self,
        saves: Option<&Bound<'py, PyDict>>,
        loads: Option<&Bound<'py, PyDict>>,
        load_blocks: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<()> {
        // Over a copy of the items: converting a value may run Python code
        // that changes the dict (iterating it then would panic).
        let items =
            |d: Option<&Bound<'py, PyDict>>| -> Vec<(Bound<'py, PyAny>, Bound<'py, PyAny>)> {
                d.map_or_else(Vec::new, |d| {
                    d.items()
                        .iter()
                        .filter_map(|kv| kv.extract().ok())
                        .collect()
                })
            };
        if load_blocks.is_some() {
            let mut b = Vec::new();
            for (k, v) in items(load_blocks) {
                let k = k.cast_into::<PyString>()?;
                b.push((str_key(&k)?.into_owned(), v.extract::<Vec<u32>>()?));
            }
            self.core.expect_load_blocks(b);
        }
        let mut s = Vec::new();
        for (k, v) in items(saves) {
            let (children, need): (u64, u32) = v.extract()?;
            s.push((k.cast_into::<PyString>()?, children, need));
        }
        let mut l = Vec::new();
        for (k, v) in items(loads) {
            l.push((k.cast_into::<PyString>()?, v.extract::<u64>()?));
        }
        let s = s
            .iter()
            .map(|(k, c, n)| Ok((str_key(k)?, *c, *n)))
            .collect::<PyResult<Vec<_>>>()?;
        let l = l
            .iter()
            .map(|(k, c)| Ok((str_key(k)?, *c)))
            .collect::<PyResult<Vec<_>>>()?;
        let s: Vec<(&str, u64, u32)> = s.iter().map(|(k, c, n)| (&**k, *c, *n)).collect();
        let l: Vec<(&str, u64)> = l.iter().map(|(k, c)| (&**k, *c)).collect();
        self.core.expect(&s, &l);
        Ok(())
    }

    /// Worker side: each child's finished-sending ids of one step (None or
    /// an iterable of ids per child, in config order) -> the requests
    /// finished sending now; completions a child did not owe are dropped.
    fn complete_sends<'py>(
        &self,
        py: Python<'py>,
        per_child: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        self.complete(py, per_child, |i, id| self.core.sent(i, id))
    }

    /// Worker side: the same for finished receiving (vLLM before
    /// `get_transfer_results`: no failures): a request passes once each
    /// child that loads it reported it; the others are dropped.
    fn complete_recvs<'py>(
        &self,
        py: Python<'py>,
        per_child: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        let out = self.complete(py, per_child, |i, id| {
            self.core.received(i, id, false).is_some()
        })?;
        self.expire_loads(&out, None)?;
        Ok(out)
    }

    /// Worker side: blocks of loads that missed their load deadline since
    /// the last call (reported with `get_block_ids_with_load_errors`).
    fn take_timed_out_blocks(&self) -> Vec<u32> {
        self.core.take_timed_out_blocks()
    }

    /// Worker side: each child's `(finished_recving, failed_recving)` of one
    /// step (None or iterables of ids) -> `(finished, failed)`: the
    /// requests finished receiving now, and those of them one of whose
    /// loaders failed (in both, as vLLM's `KVConnectorTransferResults`
    /// wants).
    fn complete_recv_results<'py>(
        &self,
        py: Python<'py>,
        per_child: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PySet>, Bound<'py, PySet>)> {
        let finished = PySet::empty(py)?;
        let failed = PySet::empty(py)?;
        let ids = |v: Bound<'py, PyAny>| -> PyResult<Vec<Bound<'py, PyString>>> {
            if v.is_none() {
                return Ok(Vec::new());
            }
            v.try_iter()?
                .map(|id| Ok(id?.cast_into::<PyString>()?))
                .collect()
        };
        for (i, pair) in per_child.try_iter()?.enumerate() {
            let (ok, bad): (Bound<'py, PyAny>, Bound<'py, PyAny>) = pair?.extract()?;
            let (ok, bad) = (ids(ok)?, ids(bad)?);
            let ok_k = ok.iter().map(str_key).collect::<PyResult<Vec<_>>>()?;
            let bad_k = bad.iter().map(str_key).collect::<PyResult<Vec<_>>>()?;
            let ok_s: Vec<&str> = ok_k.iter().map(|k| &**k).collect();
            let bad_s: Vec<&str> = bad_k.iter().map(|k| &**k).collect();
            let mut err = None;
            self.core.received_results(i, &ok_s, &bad_s, |id, f| {
                let r = finished
                    .add(*id)
                    .and_then(|()| if f { failed.add(*id) } else { Ok(()) });
                if let Err(e) = r {
                    err.get_or_insert(e);
                }
            });
            if let Some(e) = err {
                return Err(e);
            }
        }
        self.expire_loads(&finished, Some(&failed))?;
        Ok((finished, failed))
    }

    /// Worker side: requests still waiting for async-save completions.
    fn pending_sends(&self) -> usize {
        self.core.pending_sends()
    }

    /// Worker side: requests still waiting for an async load's completion.
    fn pending_recvs(&self) -> usize {
        self.core.pending_recvs()
    }

    /// Worker side: blocks children failed to load.
    fn count_load_failures(&self, blocks: u64) {
        self.core.count_load_failures(blocks);
    }

    /// Cumulative counters: `{"children": {name: {...}}, "finished": n, ...,
    /// "live_requests": n}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = self.counters_dict(py, &self.core.snapshot(), false)?;
        out.set_item("live_requests", self.core.live_requests())?;
        let breakers = PyDict::new(py);
        for i in 0..self.core.n_children() {
            if let Some(state) = self.core.breaker(i) {
                breakers.set_item(self.core.name(i), state.as_str())?;
            }
        }
        out.set_item("breakers", breakers)?;
        Ok(out)
    }

    /// Counters changed since the previous take, nested and without zeros,
    /// clashes keyed by policy; None when nothing changed. With `every_s`,
    /// only once that many seconds passed since the previous take or when
    /// no request is live (None otherwise; the counts wait for the next
    /// take). For vLLM's `get_kv_connector_stats`, called every step.
    #[pyo3(signature = (every_s = 0.0))]
    fn take_interval<'py>(
        &self,
        py: Python<'py>,
        every_s: f64,
    ) -> PyResult<Option<Bound<'py, PyDict>>> {
        let every = std::time::Duration::try_from_secs_f64(every_s).map_err(|_| {
            PyValueError::new_err(format!("every_s must be >= 0 seconds, got {every_s}"))
        })?;
        match self.core.take_interval_every(every) {
            Some(delta) if !delta.is_zero() => self.counters_dict(py, &delta, true).map(Some),
            _ => Ok(None),
        }
    }

    /// Requests the multiplexer holds state for.
    fn __len__(&self) -> usize {
        self.core.live_requests()
    }
}
