//! The multiplexer's bindings (`crate::mux`), one file per role
//! (`scheduler.rs`: `SchedulerMux`, `worker.rs`: `WorkerMux`), and
//! `metadata.rs`, the `KvmuxMetadata` the scheduler's hands the workers; this one
//! converts what both take: the children's answers, request ids, the
//! facts of each child's hooks.

use pyo3::exceptions::{PyException, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyTuple};

use super::{key_str, repr, str_key};
use crate::error::ChildFault;
use crate::mux::hma::Hma;
use crate::mux::merge::ValueEq;
use crate::mux::plan::{Fact, Fanout};
use crate::mux::requests::ChildMatch;
use crate::mux::settings::{self, BadSetting, LOAD_TIMEOUT, LOOKUP_TIMEOUT};
use crate::mux::{ChildFinish, Params};

mod metadata;
mod scheduler;
mod worker;

pub(super) use metadata::PyKvmuxMetadata;
pub(super) use scheduler::PySchedulerMux;
pub(super) use worker::PyWorkerMux;

// ------------------------------------------------------------ conversions

/// A Python value compared with Python's `==`.
pub(super) struct PyVal<'py>(pub(super) Bound<'py, PyAny>);

impl ValueEq for PyVal<'_> {
    type Error = PyErr;
    fn value_eq(&self, other: &Self) -> PyResult<bool> {
        self.0.eq(&other.0)
    }
}

/// A child's (or kvmux's own) params dict.
pub(super) struct PyParams<'py>(pub(super) Bound<'py, PyDict>);

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
pub(super) fn raised(py: Python<'_>, e: PyErr) -> ChildFault<PyErr> {
    if e.is_instance_of::<PyException>(py) {
        ChildFault::Raised(e)
    } else {
        ChildFault::Interrupt(e)
    }
}

pub(super) fn malformed<T>(why: String) -> Result<T, ChildFault<PyErr>> {
    Err(ChildFault::Malformed(why))
}

/// A child's `get_num_new_matched_tokens` answer.
pub(super) fn to_match(ans: &Bound<'_, PyAny>) -> Result<ChildMatch, ChildFault<PyErr>> {
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
pub(super) fn to_finish<'py>(
    ans: Bound<'py, PyAny>,
) -> Result<ChildFinish<PyParams<'py>>, ChildFault<PyErr>> {
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
pub(super) fn to_bool(ans: &Bound<'_, PyAny>) -> Result<bool, ChildFault<PyErr>> {
    ans.is_truthy().map_err(ChildFault::Raised)
}

/// `request.request_id`, as a Python str (its key: [`str_key`]).
pub(super) fn request_id<'py>(request: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyString>> {
    let id = request.getattr(intern!(request.py(), "request_id"))?;
    Ok(id.cast_into::<PyString>()?)
}

// ------------------------------------------------------------------ facts

/// One child's hook as the host describes it: None (the child lacks it),
/// `("constant", answer)` (its body only returns `answer`) or `("works",
/// bound method)`.
fn to_fact<T>(
    fact: &Bound<'_, PyAny>,
    convert: impl Fn(&Bound<'_, PyAny>) -> Result<T, ChildFault<PyErr>>,
) -> PyResult<Fact<Py<PyAny>, T>> {
    if fact.is_none() {
        return Ok(Fact::Missing);
    }
    let (kind, obj): (Bound<'_, PyString>, Bound<'_, PyAny>) = fact.extract()?;
    match kind.to_str()? {
        "works" => Ok(Fact::Works(obj.unbind())),
        "constant" => Ok(Fact::Constant(convert(&obj).map_err(|f| match f {
            ChildFault::Malformed(why) => why,
            ChildFault::Raised(e) | ChildFault::Interrupt(e) => e.to_string(),
        }))),
        other => Err(PyValueError::new_err(format!(
            "a hook fact is None, (\"constant\", answer) or (\"works\", method), got {other:?}"
        ))),
    }
}

/// The fan-out of one hook over `n` children, from the host's facts (None:
/// the host told nothing of the hook; every child answers `default`).
pub(super) fn fanout<T>(
    facts: Option<Bound<'_, PyAny>>,
    n: usize,
    default: impl Fn() -> T,
    convert: impl Fn(&Bound<'_, PyAny>) -> Result<T, ChildFault<PyErr>>,
) -> PyResult<Fanout<Py<PyAny>, T>> {
    let Some(facts) = facts else {
        return Ok(Fanout::none(n, default));
    };
    let facts = facts
        .try_iter()?
        .map(|f| to_fact(&f?, &convert))
        .collect::<PyResult<Vec<_>>>()?;
    if facts.len() != n {
        return Err(PyValueError::new_err(format!(
            "a hook needs one fact per child ({n}), got {}",
            facts.len()
        )));
    }
    Ok(Fanout::decide(facts, default))
}

/// A deadline setting in milliseconds from Python, by the core's bounds
/// (`mux/settings.rs`).
pub(super) fn deadline(key: &'static str, ms: f64) -> PyResult<std::time::Duration> {
    settings::deadline(key, ms).map_err(bad_setting)
}

/// A setting out of bounds, as the `ValueError` a wrong config gets.
pub(super) fn bad_setting(e: BadSetting) -> PyErr {
    PyValueError::new_err(e.to_string())
}

/// `_core.hma_refusal(supports_hma, names, groups)`: the start-up refusal
/// of a model with `groups` KV cache groups (None: unknown) with the hybrid
/// KV cache manager on, by the core's rule and words (`mux/hma.rs`); None
/// when every child can follow it.
#[pyfunction]
pub(super) fn hma_refusal(
    supports_hma: Vec<bool>,
    names: Vec<String>,
    groups: Option<usize>,
) -> PyResult<Option<String>> {
    if names.len() != supports_hma.len() {
        return Err(PyValueError::new_err(format!(
            "one name per child: {} names for {} HMA flags",
            names.len(),
            supports_hma.len()
        )));
    }
    Ok(Hma::new(supports_hma).start_refusal(groups, |i| &names[i]))
}

/// `_core.check_deadline(key, ms)`: None when `ms` is within the bounds of
/// the deadline setting `key`, else `(key, rule)`: the start-up check
/// words its refusal with the core's rule.
#[pyfunction]
pub(super) fn check_deadline(key: &str, ms: f64) -> PyResult<Option<(&'static str, String)>> {
    let key = match key {
        LOOKUP_TIMEOUT => LOOKUP_TIMEOUT,
        LOAD_TIMEOUT => LOAD_TIMEOUT,
        other => {
            return Err(PyValueError::new_err(format!(
                "{other:?} is not a deadline setting ({LOOKUP_TIMEOUT}, {LOAD_TIMEOUT})"
            )))
        }
    };
    Ok(settings::deadline(key, ms).err().map(|e| (e.key, e.rule)))
}

/// `_core.check_breaker(failures, cooldown_ms, max_cooldown_ms)`: None
/// when the breaker's settings are within the core's bounds, else `(key,
/// rule)` of the first that is not.
#[pyfunction]
pub(super) fn check_breaker(
    failures: u64,
    cooldown_ms: f64,
    max_cooldown_ms: f64,
) -> Option<(&'static str, String)> {
    settings::breaker(failures, cooldown_ms, max_cooldown_ms)
        .err()
        .map(|e| (e.key, e.rule))
}

/// A constant Python answer, taken as it is.
pub(super) fn any_answer(a: &Bound<'_, PyAny>) -> Result<Py<PyAny>, ChildFault<PyErr>> {
    Ok(a.clone().unbind())
}

/// `_core.fan_out(facts)`: the plan of a hook kvmux calls from Python,
/// decided by the core's rule (`mux/plan.rs`): `(indices of the children
/// to call, every child's constant answer)`.
#[pyfunction]
pub(super) fn fan_out(
    py: Python<'_>,
    facts: Bound<'_, PyAny>,
) -> PyResult<(Vec<usize>, Vec<Py<PyAny>>)> {
    let n = facts.len()?;
    let plan = fanout(Some(facts), n, || py.None(), any_answer)?;
    let active = plan.active().map(|(i, _)| i).collect();
    let answers = plan
        .answers()
        .iter()
        .map(|a| a.as_ref().map_or_else(|_| py.None(), |v| v.clone_ref(py)))
        .collect();
    Ok((active, answers))
}

/// The answer of child `i` in `plan`: its constant, or `call(method)`
/// converted.
pub(super) fn answer<'py, T: Clone>(
    py: Python<'py>,
    plan: &Fanout<Py<PyAny>, T>,
    i: usize,
    call: impl FnOnce(&Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
    convert: impl FnOnce(Bound<'py, PyAny>) -> Result<T, ChildFault<PyErr>>,
) -> Result<T, ChildFault<PyErr>> {
    match plan.call(i) {
        Some(f) => convert(call(f.bind(py)).map_err(|e| raised(py, e))?),
        None => plan.answer(i).map_err(ChildFault::Malformed),
    }
}

/// Counters as a dict; `sparse` drops zeros and folds the clash counters
/// into `{"clashes": {policy: n}}` (see `Snapshot::report`).
pub(super) fn counters_dict<'py, 'a>(
    py: Python<'py>,
    snap: &crate::mux::stats::Snapshot,
    sparse: bool,
    clash_policy: &'static str,
    name: impl Fn(usize) -> &'a str,
) -> PyResult<Bound<'py, PyDict>> {
    use pyo3::types::IntoPyDict;
    let report = snap.report(sparse, clash_policy);
    let out = PyDict::new(py);
    let children = PyDict::new(py);
    for (i, kv) in report.children {
        children.set_item(name(i), kv.into_py_dict(py)?)?;
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
