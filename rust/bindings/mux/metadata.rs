//! `KvmuxMetadata`: what `SchedulerMux::build_connector_meta` hands the
//! workers once per step, as a Python object of the bindings' own (no
//! kvmux Python class is called to build it). `kvmux.mux.metadata` registers it
//! as a vLLM `KVConnectorMetadata`; it pickles by value (`__reduce__`), as
//! vLLM sends it to the worker processes.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

/// Scheduler -> workers, once per step.
///
/// - `children`: each child's own metadata, in config order.
/// - `saves`: requests finished this step that children save
///   asynchronously: request id -> (bit set of those children, how many of
///   their completions the workers wait for: all of them, or 1 for a
///   request kvmux never tracked). A completion from another child is
///   dropped. None when there are none.
/// - `loads`: requests loading asynchronously from this step on: request
///   id -> bit set of the children loading it asynchronously (one, or
///   several spans under `compose`); the request is finished receiving once
///   each reported it, and no other child's receive completion reaches
///   vLLM. None when there are none.
/// - `load_blocks`: of those loaded by a child with a `load_timeout_ms`:
///   request id -> the device blocks the load writes (group 0), which a
///   worker reports as load errors if the load misses its deadline (vLLM
///   without failed receives). None when there are none.
#[pyclass(module = "kvmux._core", name = "KvmuxMetadata", frozen, get_all)]
pub(crate) struct PyKvmuxMetadata {
    children: Py<PyTuple>,
    saves: Option<Py<PyDict>>,
    loads: Option<Py<PyDict>>,
    load_blocks: Option<Py<PyDict>>,
}

impl PyKvmuxMetadata {
    pub(super) fn build<'py>(
        py: Python<'py>,
        children: Bound<'py, PyTuple>,
        saves: Option<Bound<'py, PyDict>>,
        loads: Option<Bound<'py, PyDict>>,
        load_blocks: Option<Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, Self>> {
        Bound::new(
            py,
            Self {
                children: children.unbind(),
                saves: saves.map(Bound::unbind),
                loads: loads.map(Bound::unbind),
                load_blocks: load_blocks.map(Bound::unbind),
            },
        )
    }
}

#[pymethods]
impl PyKvmuxMetadata {
    #[new]
    #[pyo3(signature = (children, saves = None, loads = None, load_blocks = None))]
    fn new<'py>(
        children: &Bound<'py, PyAny>,
        saves: Option<Bound<'py, PyDict>>,
        loads: Option<Bound<'py, PyDict>>,
        load_blocks: Option<Bound<'py, PyDict>>,
    ) -> PyResult<Self> {
        let py = children.py();
        let children = match children.cast::<PyTuple>() {
            Ok(t) => t.clone(),
            Err(_) => PyTuple::new(py, children.try_iter()?.collect::<PyResult<Vec<_>>>()?)?,
        };
        Ok(Self {
            children: children.unbind(),
            saves: saves.map(Bound::unbind),
            loads: loads.map(Bound::unbind),
            load_blocks: load_blocks.map(Bound::unbind),
        })
    }

    /// Pickled by value: `KvmuxMetadata(children, saves, loads, load_blocks)`.
    fn __reduce__<'py>(slf: &Bound<'py, Self>) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let me = slf.get();
        let args = (&me.children, &me.saves, &me.loads, &me.load_blocks).into_pyobject(py)?;
        PyTuple::new(py, [slf.get_type().into_any(), args.into_any()])
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let r = |o: &Option<Py<PyDict>>| -> PyResult<String> {
            Ok(match o {
                Some(d) => d.bind(py).repr()?.to_string(),
                None => "None".into(),
            })
        };
        Ok(format!(
            "KvmuxMetadata(children={}, saves={}, loads={}, load_blocks={})",
            self.children.bind(py).repr()?,
            r(&self.saves)?,
            r(&self.loads)?,
            r(&self.load_blocks)?,
        ))
    }
}
