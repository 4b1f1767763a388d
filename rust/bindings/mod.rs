//! The only code that knows PyO3, one folder per product, mirroring the
//! core (`mux/` for `crate::mux`, `host_tier/` for `crate::host_tier`);
//! this one holds the module and the error classes.
//! It converts, and nothing else: Python answers of the children into the
//! core's values, the core's answers and errors into Python objects and
//! exceptions.

use pyo3::exceptions::PyRuntimeError;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyBytes, PyString, PyType};

use std::borrow::Cow;
use std::fmt::Write;

use crate::mux::merge::ClashPolicy;
use crate::mux::requests::{LoadPolicy, MAX_CHILDREN};
use crate::mux::stats::{CHILD_NAMES, TOTAL_NAMES};
use crate::mux::{BY_CHILD_KEY, EXTRA_KEY, LOCAL_KEY};

mod host_tier;
mod mux;

use host_tier::{py_chain_token_hashes, PyHostIndex, PyReservation, PyServablePrefix};
use mux::{
    check_breaker, check_deadline, fan_out, hma_refusal, PyKvmuxMetadata, PySchedulerMux,
    PyWorkerMux,
};

// ------------------------------------------------------------------- keys

/// Starts the key of a str that is not valid UTF-8 (see [`str_key`]); a
/// noncharacter, so no id vLLM makes starts with it.
const ESCAPE: char = '\u{FDD0}';

/// A Python str (a request id) as a Rust key, the mux's request keys and
/// the host index's owners alike: the str itself when it is valid UTF-8
/// (every id vLLM makes), else (a lone surrogate, from a client's request
/// id) the escape followed by the hex of its `surrogatepass` bytes. Keys are opaque:
/// any str is one, and distinct strs are distinct keys (a valid str that
/// starts with the escape is escaped too).
pub(crate) fn str_key<'a>(s: &'a Bound<'_, PyString>) -> PyResult<Cow<'a, str>> {
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
pub(crate) fn key_str<'py>(py: Python<'py>, key: &str) -> PyResult<Bound<'py, PyString>> {
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

// ------------------------------------------------------------------ errors

/// kvmux's Python exception classes, bound once by `kvmux.errors` at import
/// (`_core.bind_errors`).
pub(crate) struct ErrorTypes {
    pub(crate) child: Py<PyType>,
    pub(crate) clash: Py<PyType>,
    pub(crate) config: Py<PyType>,
}

static ERRORS: PyOnceLock<ErrorTypes> = PyOnceLock::new();

/// Called once by `kvmux.errors`: the classes the core's errors become.
#[pyfunction]
fn bind_errors(
    py: Python<'_>,
    child: Bound<'_, PyType>,
    clash: Bound<'_, PyType>,
    config: Bound<'_, PyType>,
) {
    let _ = ERRORS.set(
        py,
        ErrorTypes {
            child: child.unbind(),
            clash: clash.unbind(),
            config: config.unbind(),
        },
    );
}

pub(crate) fn raise<'py, A>(py: Python<'py>, cls: fn(&ErrorTypes) -> &Py<PyType>, args: A) -> PyErr
where
    A: pyo3::call::PyCallArgs<'py>,
{
    let Some(types) = ERRORS.get(py) else {
        return PyRuntimeError::new_err("kvmux._core used before kvmux.errors was imported");
    };
    match cls(types).bind(py).call1(args) {
        Ok(e) => PyErr::from_value(e),
        Err(e) => e,
    }
}

pub(crate) fn repr(obj: &Bound<'_, PyAny>) -> String {
    obj.repr()
        .map_or_else(|_| "<unprintable>".to_owned(), |r| r.to_string())
}

#[pymodule(gil_used = false)]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PySchedulerMux>()?;
    m.add_class::<PyWorkerMux>()?;
    m.add_class::<PyKvmuxMetadata>()?;
    m.add_function(wrap_pyfunction!(fan_out, m)?)?;
    m.add_function(wrap_pyfunction!(check_deadline, m)?)?;
    m.add_function(wrap_pyfunction!(check_breaker, m)?)?;
    m.add_function(wrap_pyfunction!(hma_refusal, m)?)?;
    m.add("HMA_FIX", crate::mux::hma::FIX)?;
    m.add("SCHEDULER_HOOKS", crate::mux::hook::SCHEDULER.to_vec())?;
    m.add_function(wrap_pyfunction!(bind_errors, m)?)?;
    m.add_class::<PyHostIndex>()?;
    m.add_class::<PyServablePrefix>()?;
    m.add_class::<PyReservation>()?;
    m.add_function(wrap_pyfunction!(py_chain_token_hashes, m)?)?;
    m.add("CLASH_POLICIES", ClashPolicy::ALL.to_vec())?;
    m.add("LOAD_POLICIES", LoadPolicy::ALL.to_vec())?;
    m.add("LOAD_DECISIONS", crate::mux::cost::LOAD_DECISIONS.to_vec())?;
    m.add("SAVE_POLICIES", crate::mux::admit::SAVE_POLICIES.to_vec())?;
    m.add("DEFAULT_REUSE", crate::mux::admit::DEFAULT_REUSE)?;
    m.add("MAX_CHILDREN", MAX_CHILDREN)?;
    m.add("EXTRA_KEY", EXTRA_KEY)?;
    m.add("BY_CHILD_KEY", BY_CHILD_KEY)?;
    m.add("LOCAL_KEY", LOCAL_KEY)?;
    m.add("CHILD_COUNTERS", CHILD_NAMES.to_vec())?;
    m.add("TOTAL_COUNTERS", TOTAL_NAMES.to_vec())?;
    Ok(())
}
