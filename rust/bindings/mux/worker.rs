//! `kvmux._core.WorkerMux`: the bindings of `crate::mux::WorkerMux`, the
//! completions a worker waits for and its counters.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySet, PyString};

use std::time::Instant;

use super::{counters_dict, deadline, str_key};
use crate::error::MuxError;
use crate::mux::settings::LOAD_TIMEOUT;
use crate::mux::WorkerMux;

/// The worker side of the multiplexer.
#[pyclass(frozen, name = "WorkerMux", module = "kvmux._core")]
pub struct PyWorkerMux {
    core: WorkerMux,
}

impl PyWorkerMux {
    /// Each child's ids of one step (None or an iterable of ids per child,
    /// in config order) -> the requests `done(i, key)` says are finished.
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

    /// Loads past their child's load deadline are failed (see
    /// `WorkerMux::expire_loads`): each request reported now is added to
    /// `finished` (and `failed`).
    fn expire_loads(
        &self,
        finished: &Bound<'_, PySet>,
        failed: Option<&Bound<'_, PySet>>,
    ) -> PyResult<()> {
        let mut err = None;
        self.core.expire_loads(Instant::now(), |id| {
            let r = finished
                .add(id)
                .and_then(|()| failed.map_or(Ok(()), |f| f.add(id)));
            if let Err(e) = r {
                err.get_or_insert(e);
            }
        });
        err.map_or(Ok(()), Err)
    }
}

#[pymethods]
impl PyWorkerMux {
    /// `names`: the children's, in config order; `load_timeouts_ms[i]`:
    /// child i's load deadline (None: none).
    #[new]
    fn new(names: Vec<String>, load_timeouts_ms: Vec<Option<f64>>) -> PyResult<Self> {
        let deadlines = load_timeouts_ms
            .into_iter()
            .map(|t| t.map(|t| deadline(LOAD_TIMEOUT, t)).transpose())
            .collect::<PyResult<Vec<_>>>()?;
        let core = WorkerMux::new(names, deadlines)
            .map_err(|e: MuxError<PyErr>| PyValueError::new_err(e.to_string()))?;
        Ok(Self { core })
    }

    /// The completions the scheduler side announced in its metadata
    /// (`saves`: request id -> (bit set of the saving children,
    /// completions needed); `loads`: request id -> bit set of the children
    /// loading it asynchronously; `load_blocks`: request id -> the blocks
    /// of a load by a child with a load deadline, reported as load errors
    /// if it misses it: pass them only where vLLM has no failed receives).
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

    /// Each child's finished-sending ids of one step (None or an iterable
    /// of ids per child, in config order) -> the requests finished sending
    /// now; completions a child did not owe are dropped.
    fn complete_sends<'py>(
        &self,
        py: Python<'py>,
        per_child: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PySet>> {
        self.complete(py, per_child, |i, id| self.core.sent(i, id))
    }

    /// The same for finished receiving (vLLM before
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

    /// Blocks of loads that missed their load deadline since the last call
    /// (reported with `get_block_ids_with_load_errors`).
    fn take_timed_out_blocks(&self) -> Vec<u32> {
        self.core.take_timed_out_blocks()
    }

    /// Each child's `(finished_recving, failed_recving)` of one step (None
    /// or iterables of ids) -> `(finished, failed)`: the requests finished
    /// receiving now, and those of them one of whose loaders failed (in
    /// both, as vLLM's `KVConnectorTransferResults` wants).
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

    /// Requests still waiting for async-save completions.
    fn pending_sends(&self) -> usize {
        self.core.pending_sends()
    }

    /// Requests still waiting for an async load's completion.
    fn pending_recvs(&self) -> usize {
        self.core.pending_recvs()
    }

    /// Blocks children failed to load.
    fn count_load_failures(&self, blocks: u64) {
        self.core.count_load_failures(blocks);
    }

    /// Cumulative counters: `{"children": {name: {...}}, ...,
    /// "live_requests": 0, "breakers": {}}` (a worker holds no request
    /// state and no breaker).
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = counters_dict(py, &self.core.snapshot(), false, "", |i| self.core.name(i))?;
        out.set_item("live_requests", 0)?;
        out.set_item("breakers", PyDict::new(py))?;
        Ok(out)
    }

    /// Counters changed since the previous take, nested and without zeros;
    /// None when nothing changed.
    fn take_interval<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        match self.core.take_interval() {
            Some(delta) if !delta.is_zero() => {
                counters_dict(py, &delta, true, "", |i| self.core.name(i)).map(Some)
            }
            _ => Ok(None),
        }
    }
}
