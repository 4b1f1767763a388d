//! `kvmux._core.SchedulerMux`: the bindings of `crate::mux::SchedulerMux`.
//!
//! Its methods named as vLLM's hooks (`SCHEDULER_HOOKS`) are the
//! scheduler-side connector's: vLLM's call goes straight into Rust, which
//! calls the children the core's plan says to call (their bound methods,
//! handed over once at construction) and converts their answers, with no
//! Python frame of kvmux's in between. Every rule is the core's; this file
//! converts.

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PySet, PyString, PyTuple};

use std::borrow::Cow;
use std::collections::HashSet;
use std::ops::Range;
use std::time::Duration;

use super::super::raise;
use super::{
    answer, any_answer, bad_setting, deadline, fanout, key_str, raised, request_id, str_key,
    to_bool, to_finish, to_match, PyKvmuxMetadata, PyParams,
};
use crate::error::{ChildFault, MuxError};
use crate::mux::hma::Route;
use crate::mux::merge::ClashPolicy;
use crate::mux::notice::{fault_detail, Notice};
use crate::mux::plan::{worker_meta_entries, Fanout};
use crate::mux::requests::{ChildMatch, LoadPolicy};
use crate::mux::settings::{self, LOAD_TIMEOUT, LOOKUP_TIMEOUT};
use crate::mux::{admit, cost};
use crate::mux::{
    hook, wall_clock, About, ChildAnswer, ChildFinish, FinishHooks, FinishedParams, SchedulerMux,
    Supplied, Timeline, Want, BY_CHILD_KEY, EXTRA_KEY, LOCAL_KEY,
};

type Plan<T> = Fanout<Py<PyAny>, T>;

/// The scheduler side of the multiplexer, with its children's hooks.
#[pyclass(frozen, name = "SchedulerMux", module = "kvmux._core")]
pub struct PySchedulerMux {
    core: SchedulerMux,
    logger: Py<PyAny>,
    lookup: Plan<ChildMatch>,
    alloc: Plan<()>,
    finished: Plan<bool>,
    finished_all_groups: Plan<bool>,
    partial_tail: Plan<bool>,
    on_new_request: Plan<Py<PyAny>>,
    build_meta: Plan<Py<PyAny>>,
    update_output: Plan<Py<PyAny>>,
    child_stats: Plan<Py<PyAny>>,
    /// Every child's stats are a constant None (none is called).
    stats_all_none: bool,
    stats_every: Duration,
    /// The children whose own hits-by-source split is asked (the others
    /// count their span under their own source, vLLM's default).
    hit_split: Plan<Py<PyAny>>,
    /// vLLM's hit sources, when it has the split (0.33+).
    sources: Option<HitSources>,
    /// What `get_kv_connector_stats` wraps its data in (`KvmuxStats`).
    stats_class: Option<Py<PyAny>>,
    /// Gets the finished requests' timelines (a list of dicts) after each
    /// finish (`timeline_path`).
    timeline_sink: Option<Py<PyAny>>,
    /// `(scheduler_output, hidden) -> view`: the step without the requests
    /// in `hidden` (save admission; `kvmux.mux.scheduler.without_requests`).
    scheduler_view: Option<Py<PyAny>>,
}

/// vLLM's `CacheHitSource` as the bindings hand it to vLLM: each member by
/// value, each child's own source, and the multiplexer's own (vLLM's
/// default answer when no child loads).
struct HitSources {
    by_value: Py<PyDict>,
    own: Vec<String>,
    default: Py<PyAny>,
}

impl HitSources {
    /// A child's split as `(source value, tokens)` pairs; None when it is
    /// not a dict of vLLM's sources (members or their values) to token
    /// counts >= 0 (then the child's span counts under its own source).
    fn pairs(&self, py: Python<'_>, got: &Bound<'_, PyAny>) -> Option<Vec<(String, u64)>> {
        let d = got.cast::<PyDict>().ok()?;
        let by_value = self.by_value.bind(py);
        let mut out = Vec::with_capacity(d.len());
        for (k, n) in d.iter() {
            let value: String = k.extract().ok()?;
            if !by_value.contains(&value).ok()? {
                return None;
            }
            out.push((value, n.extract().ok()?));
        }
        Some(out)
    }
}

/// A constant finish answer: an async-save flag (constant params are not
/// a finish answer a child can give without being called).
fn finish_const(a: &Bound<'_, PyAny>) -> Result<bool, ChildFault<PyErr>> {
    let f = to_finish(a.clone())?;
    if f.params.is_some() {
        return Err(ChildFault::Malformed("returned constant params".into()));
    }
    Ok(f.async_save)
}

/// A finish hook's calls into Python ([`FinishHooks`]): child `i` gets
/// `route.hook(i)` with `all` (every group's blocks) or `one` (the one
/// group's). Conversions only; the rules are the core's.
struct FinishCalls<'a, 'py> {
    mux: &'a PySchedulerMux,
    py: Python<'py>,
    request: &'a Bound<'py, PyAny>,
    route: Route<'a>,
    all: &'a Bound<'py, PyAny>,
    one: &'a Bound<'py, PyAny>,
    /// The request's own `kv_transfer_params` (None when empty).
    asked_params: Option<Bound<'py, PyDict>>,
}

impl<'py> FinishHooks for FinishCalls<'_, 'py> {
    type Params = PyParams<'py>;

    fn hook(&self, i: usize) -> &'static str {
        self.route.hook(i)
    }

    fn asked(&self, key: &str) -> bool {
        self.asked_params
            .as_ref()
            .is_some_and(|d| d.contains(key).unwrap_or(false))
    }

    fn own(&mut self, s: &Supplied) -> PyResult<PyParams<'py>> {
        let py = self.py;
        let d = PyDict::new(py);
        if s.want.extra {
            d.set_item(EXTRA_KEY, s.extra)?;
        }
        if s.want.by_child {
            let split = PyDict::new(py);
            for (i, n) in s.by_child.iter().enumerate() {
                split.set_item(self.mux.core.name(i), n)?;
            }
            split.set_item(LOCAL_KEY, s.local)?;
            d.set_item(BY_CHILD_KEY, split)?;
        }
        Ok(PyParams(d))
    }

    fn call(&mut self, i: usize) -> ChildAnswer<ChildFinish<PyParams<'py>>, PyErr> {
        let plan = if self.route.all_groups_hook(i) {
            &self.mux.finished_all_groups
        } else {
            &self.mux.finished
        };
        let blocks = if self.route.as_passed(i) {
            self.all
        } else {
            self.one
        };
        match plan.call(i) {
            Some(f) => to_finish(
                f.bind(self.py)
                    .call1((self.request, blocks))
                    .map_err(|e| raised(self.py, e))?,
            ),
            None => plan
                .answer(i)
                .map(|async_save| ChildFinish {
                    async_save,
                    params: None,
                })
                .map_err(ChildFault::Malformed),
        }
    }
}

/// One child's settings as the host hands them over: `(name, supports
/// HMA, lookup_timeout_ms, load_timeout_ms, breaker (failures,
/// cooldown_ms, max_cooldown_ms))`.
type ChildSettings = (
    String,
    bool,
    Option<f64>,
    Option<f64>,
    Option<(u64, f64, f64)>,
);

impl PySchedulerMux {
    /// A core error as the Python exception users see.
    fn error(&self, py: Python<'_>, e: MuxError<PyErr>) -> PyErr {
        match e {
            MuxError::Child {
                fault: ChildFault::Interrupt(e),
                ..
            } => e,
            MuxError::Child { child, hook, fault } => {
                let detail = fault_detail(hook, &fault);
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
            } => raise(
                py,
                |t| &t.config,
                (self.core.refusal(&request, groups, &children),),
            ),
            MuxError::Config(msg) => PyValueError::new_err(msg),
        }
    }

    fn child_error(&self, py: Python<'_>, hook: &'static str, i: usize, e: PyErr) -> PyErr {
        self.error(py, MuxError::child(i, hook, raised(py, e)))
    }

    /// Hand the core's notices to the `kvmux` logger as they are.
    fn log(&self, py: Python<'_>, notices: Vec<Notice>) {
        if notices.is_empty() {
            return;
        }
        let logger = self.logger.bind(py);
        for n in notices {
            let _ = logger.call_method1(intern!(py, "log"), (n.level.number(), "%s", n.text));
        }
    }

    /// Every active child of `plan` called with `call(method)`, in config
    /// order; every child's answer (the constants included).
    fn answers<'py>(
        &self,
        py: Python<'py>,
        plan: &Plan<Py<PyAny>>,
        hook: &'static str,
        call: impl Fn(usize, &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>>,
    ) -> PyResult<Vec<Bound<'py, PyAny>>> {
        let mut out: Vec<Bound<'py, PyAny>> = plan
            .answers()
            .iter()
            .map(|a| match a {
                Ok(v) => v.bind(py).clone(),
                Err(_) => py.None().into_bound(py),
            })
            .collect();
        for (i, f) in plan.active() {
            out[i] = call(i, f.bind(py)).map_err(|e| self.child_error(py, hook, i, e))?;
        }
        Ok(out)
    }

    /// A finish hook: child `i` gets `route.hook(i)` with `all` (every
    /// group's blocks) or `one` (the one group's).
    fn finish<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        route: Route<'_>,
        all: &Bound<'py, PyAny>,
        one: &Bound<'py, PyAny>,
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
        let mut calls = FinishCalls {
            mux: self,
            py,
            request,
            route,
            all,
            one,
            asked_params,
        };
        let done = self
            .core
            .finish(req_id, want, &mut calls)
            .map_err(|e| self.error(py, e))?;
        self.log(
            py,
            self.core
                .exit_notices(req_id, &done.contained, &done.new_clashes),
        );
        if let Some(sink) = &self.timeline_sink {
            let lines = self.core.take_timelines();
            if !lines.is_empty() {
                let dicts = lines
                    .iter()
                    .map(|t| timeline_dict(py, &self.core, t))
                    .collect::<PyResult<Vec<_>>>()?;
                sink.bind(py).call1((dicts,))?;
            }
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

    /// The step's completions go by the core first (`reported`); those it
    /// holds back are taken out of what vLLM reads (a held receive from
    /// `failed_recving` too).
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

    /// What the workers must be told with the next step's metadata, each
    /// map keyed by the requests' own ids, None when empty.
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
        Ok((
            by_id(py, out.saves)?,
            by_id(py, out.loads)?,
            by_id(py, out.load_blocks)?,
        ))
    }
}

#[pymethods]
impl PySchedulerMux {
    /// `children`: per child `(name, supports_hma, lookup_timeout_ms,
    /// load_timeout_ms, breaker)`; `hooks`: hook name -> one fact per child
    /// (see `kvmux.mux.children.Children.facts`), a hook left out answered by
    /// every child with vLLM's default.
    #[new]
    #[pyo3(signature = (children, clash_policy, load_policy, block_size, hooks, logger, stats_every_s = 1.0, hit_sources = None, stats_class = None, load_decision = "always", timeline_sink = None, save_policies = None, scheduler_view = None, save_table_blocks = None, transports = None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        children: Vec<ChildSettings>,
        clash_policy: &str,
        load_policy: &str,
        block_size: u64,
        hooks: &Bound<'_, PyDict>,
        logger: Bound<'_, PyAny>,
        stats_every_s: f64,
        hit_sources: Option<(Bound<'_, PyDict>, Vec<String>, Bound<'_, PyAny>)>,
        stats_class: Option<Bound<'_, PyAny>>,
        load_decision: &str,
        timeline_sink: Option<Bound<'_, PyAny>>,
        save_policies: Option<Vec<Bound<'_, PyAny>>>,
        scheduler_view: Option<Bound<'_, PyAny>>,
        save_table_blocks: Option<usize>,
        transports: Option<Vec<bool>>,
    ) -> PyResult<Self> {
        let decide = cost::decides(load_decision).ok_or_else(|| {
            PyValueError::new_err(format!(
                "load_decision must be one of {:?}, got {load_decision:?}",
                cost::LOAD_DECISIONS
            ))
        })?;
        let n = children.len();
        let clash: ClashPolicy = clash_policy.parse().map_err(PyValueError::new_err)?;
        let load: LoadPolicy = load_policy.parse().map_err(PyValueError::new_err)?;
        let mut names = Vec::with_capacity(n);
        let (mut hma, mut deadlines, mut load_deadlines, mut breakers) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (name, supports_hma, lookup_ms, load_ms, breaker) in children {
            names.push(name);
            hma.push(supports_hma);
            deadlines.push(lookup_ms.map(|t| deadline(LOOKUP_TIMEOUT, t)).transpose()?);
            load_deadlines.push(load_ms.map(|t| deadline(LOAD_TIMEOUT, t)).transpose()?);
            breakers.push(
                breaker
                    .map(|(failures, cooldown, max)| settings::breaker(failures, cooldown, max))
                    .transpose()
                    .map_err(bad_setting)?,
            );
        }
        let policies = match save_policies {
            None => vec![admit::Policy::Always; n],
            Some(p) => p.iter().map(save_policy).collect::<PyResult<_>>()?,
        };
        let core = SchedulerMux::new(names, clash, load, block_size)
            .and_then(|m| {
                m.with_save_policies(policies, &transports.unwrap_or_default(), save_table_blocks)
            })
            .and_then(|m| m.with_lookup_deadlines(deadlines))
            .and_then(|m| m.with_breakers(breakers))
            .and_then(|m| m.with_load_deadlines(load_deadlines))
            .and_then(|m| m.with_hma(hma))
            .map(|m| m.with_measure(decide, timeline_sink.is_some(), wall_clock))
            .map_err(|e: MuxError<PyErr>| PyValueError::new_err(e.to_string()))?;
        let stats_every = Duration::try_from_secs_f64(stats_every_s).map_err(|_| {
            PyValueError::new_err(format!("stats_every_s must be >= 0, got {stats_every_s}"))
        })?;
        let facts = |name: &str| hooks.get_item(name);
        let no_match = ChildMatch {
            tokens: Some(0),
            load_async: false,
        };
        let none = || py.None();
        let child_stats: Plan<Py<PyAny>> = fanout(facts(hook::STATS)?, n, none, any_answer)?;
        let stats_all_none = !child_stats.any_active()
            && child_stats
                .answers()
                .iter()
                .all(|a| a.as_ref().is_ok_and(|v| v.is_none(py)));
        Ok(Self {
            lookup: fanout(facts(hook::LOOKUP)?, n, || no_match, to_match)?,
            alloc: fanout(facts(hook::ALLOC)?, n, || (), |_| Ok(()))?,
            finished: fanout(facts(hook::FINISHED)?, n, || false, finish_const)?,
            finished_all_groups: fanout(
                facts(hook::FINISHED_ALL_GROUPS)?,
                n,
                || false,
                finish_const,
            )?,
            partial_tail: fanout(facts(hook::PARTIAL_TAIL)?, n, || false, to_bool)?,
            on_new_request: fanout(facts(hook::ON_NEW_REQUEST)?, n, none, any_answer)?,
            build_meta: fanout(facts(hook::BUILD_META)?, n, none, any_answer)?,
            update_output: fanout(facts(hook::UPDATE_OUTPUT)?, n, none, any_answer)?,
            child_stats,
            stats_all_none,
            hit_split: fanout(facts(hook::HIT_SOURCES)?, n, none, any_answer)?,
            sources: match hit_sources {
                Some((by_value, own, default)) if own.len() == n => Some(HitSources {
                    by_value: by_value.unbind(),
                    own,
                    default: default.unbind(),
                }),
                Some((_, own, _)) => {
                    return Err(PyValueError::new_err(format!(
                        "hit_sources: one own source per child ({n}), got {}",
                        own.len()
                    )))
                }
                None => None,
            },
            stats_class: stats_class.map(Bound::unbind),
            timeline_sink: timeline_sink.map(Bound::unbind),
            scheduler_view: scheduler_view.map(Bound::unbind),
            logger: logger.unbind(),
            stats_every,
            core,
        })
    }

    /// vLLM's `get_num_new_matched_tokens`: every child asked (those whose
    /// answer is constant are not called), the loading child chosen by the
    /// load policy and remembered (`SchedulerMux::lookup`).
    fn get_num_new_matched_tokens(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        num_computed_tokens: u64,
    ) -> PyResult<(Option<u64>, bool)> {
        let rid = request_id(request)?;
        let req_id = &*str_key(&rid)?;
        let about = if self.core.measuring() {
            Some(About {
                arrival: request.getattr(intern!(py, "arrival_time"))?.extract()?,
                prompt_tokens: request
                    .getattr(intern!(py, "num_prompt_tokens"))?
                    .extract()?,
            })
        } else {
            None
        };
        let got = self
            .core
            .lookup_about(req_id, num_computed_tokens, about, |i, computed| {
                answer(
                    py,
                    &self.lookup,
                    i,
                    |f| f.call1((request, computed)),
                    |a| to_match(&a),
                )
            })
            .map_err(|e| self.error(py, e))?;
        self.log(py, self.core.lookup_notices(req_id, &got.contained));
        if got.tokens.is_some() && self.core.admission_due(req_id) {
            let hashes = block_hashes(py, request)?;
            let asked = asks_save(py, request)?;
            self.core.admit_saves(req_id, hashes, asked);
        }
        Ok((got.tokens, got.load_async))
    }

    /// vLLM's `update_state_after_alloc` (`SchedulerMux::allocated`).
    fn update_state_after_alloc(
        &self,
        py: Python<'_>,
        request: &Bound<'_, PyAny>,
        blocks: &Bound<'_, PyAny>,
        num_external_tokens: u64,
    ) -> PyResult<()> {
        let rid = request_id(request)?;
        // Each group's blocks in the load's range (`range`: block indices).
        let load_blocks = |range: Range<usize>| -> PyResult<Vec<Vec<u32>>> {
            if blocks.is_none() {
                return Ok(Vec::new());
            }
            let cut = |n: usize| range.start.min(n)..range.end.min(n);
            // vLLM's KVCacheBlocks: only the load's blocks are read (not a
            // list of every block id of every group, `get_block_ids()`).
            if let Ok(groups) = blocks.getattr(intern!(py, "blocks")) {
                let mut out = Vec::new();
                for group in groups.try_iter()? {
                    let group = group?;
                    let ids = cut(group.len()?)
                        .map(|j| {
                            group
                                .get_item(j)?
                                .getattr(intern!(py, "block_id"))?
                                .extract()
                        })
                        .collect::<PyResult<Vec<u32>>>()?;
                    out.push(ids);
                }
                return Ok(out);
            }
            let all: Vec<Vec<u32>> = blocks
                .call_method0(intern!(py, "get_block_ids"))?
                .extract()?;
            Ok(all.into_iter().map(|g| g[cut(g.len())].to_vec()).collect())
        };
        self.core
            .allocated(
                &str_key(&rid)?,
                num_external_tokens,
                load_blocks,
                |i, n| match self.alloc.call(i) {
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

    /// vLLM's `request_finished`: every child's, with the same blocks
    /// (`SchedulerMux::finish`).
    fn request_finished<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block_ids: Bound<'py, PyAny>,
    ) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        self.finish(py, request, Route::Plain, &block_ids, &block_ids)
    }

    /// vLLM's `request_finished_all_groups`: routed by the core
    /// (`SchedulerMux::finish_route`); a request children without HMA
    /// cannot take raises `KvmuxConfigError` naming them
    /// (`SchedulerMux::refuse`).
    fn request_finished_all_groups<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        block_ids: Bound<'py, PyAny>,
    ) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        let route = match self.core.finish_route(block_ids.len()?) {
            Ok(r) => r,
            Err(e) => {
                let req_id = str_key(&request_id(request)?)?.into_owned();
                return Err(self.error(py, self.core.refuse(&req_id, e)));
            }
        };
        // A child without HMA gets the one group's blocks.
        let one = match route {
            Route::Mixed(_) => block_ids.get_item(0)?,
            _ => block_ids.clone(),
        };
        self.finish(py, request, route, &block_ids, &one)
    }

    /// vLLM's `register_finished_partial_tail`: true when any child keeps
    /// the request's blocks for a partial tail (`SchedulerMux::partial_tail`).
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
                answer(
                    py,
                    &self.partial_tail,
                    i,
                    |f| f.call1((request, block_ids, partial_tail_offloads)),
                    |a| to_bool(&a),
                )
            })
            .map_err(|e| self.error(py, e))?;
        self.log(py, self.core.exit_notices(req_id, &contained, &[]));
        Ok(keep)
    }

    /// vLLM's `on_new_request`: the children whose hook does something
    /// hear of the request.
    fn on_new_request(&self, py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<()> {
        for (i, f) in self.on_new_request.active() {
            f.bind(py)
                .call1((request,))
                .map_err(|e| self.child_error(py, hook::ON_NEW_REQUEST, i, e))?;
        }
        Ok(())
    }

    /// vLLM's `build_connector_meta`: every child's metadata in config
    /// order, and what the workers must know of the requests since the
    /// last step (taken once every child has answered).
    fn build_connector_meta<'py>(
        &self,
        py: Python<'py>,
        scheduler_output: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyKvmuxMetadata>> {
        // A step without its tokens (a test's None) is not measured.
        let measured = if self.core.measuring() && !scheduler_output.is_none() {
            let tokens = scheduler_output
                .getattr(intern!(py, "total_num_scheduled_tokens"))?
                .extract()?;
            let per = scheduler_output.getattr(intern!(py, "num_scheduled_tokens"))?;
            Some((tokens, per.cast_into::<PyDict>()?))
        } else {
            None
        };
        if let Some((tokens, per)) = measured {
            self.core.step_scheduled(tokens, |id| {
                per.get_item(id)
                    .ok()
                    .flatten()
                    .and_then(|n| n.extract().ok())
            });
        }
        // Save admission: a child sees the step without the requests whose
        // save it was declined (`SchedulerMux::save_declined`), through the
        // view `scheduler_view(scheduler_output, hidden)` builds.
        let mut views: Vec<Option<Bound<'py, PyAny>>> = Vec::new();
        if let (true, Some(view)) = (self.core.admitting(), &self.scheduler_view) {
            let n = self.core.n_children();
            let mut hidden: Vec<Vec<Bound<'py, PyAny>>> = vec![Vec::new(); n];
            // A step without its scheduled requests' tokens (a test's None)
            // hides nothing.
            let per = scheduler_output
                .getattr(intern!(py, "num_scheduled_tokens"))
                .ok()
                .and_then(|p| p.cast_into::<PyDict>().ok());
            for id in per.iter().flat_map(|p| p.keys()) {
                let key = id.cast::<PyString>()?;
                let mut bits = self.core.save_declined(&str_key(key)?);
                while bits != 0 {
                    let i = bits.trailing_zeros() as usize;
                    hidden[i].push(id.clone());
                    bits &= bits - 1;
                }
            }
            for h in hidden {
                views.push(if h.is_empty() {
                    None
                } else {
                    Some(
                        view.bind(py)
                            .call1((scheduler_output, PySet::new(py, &h)?))?,
                    )
                });
            }
        }
        let metas = self.answers(py, &self.build_meta, hook::BUILD_META, |i, f| {
            match views.get(i) {
                Some(Some(v)) => f.call1((v,)),
                _ => f.call1((scheduler_output,)),
            }
        })?;
        let (saves, loads, load_blocks) = self.take_outbox(py)?;
        PyKvmuxMetadata::build(py, PyTuple::new(py, metas)?, saves, loads, load_blocks)
    }

    /// vLLM's `update_connector_output`: loads the workers report failed
    /// (`invalid_block_ids`, `failed_recving`) stop counting as loaded; each
    /// child whose hook does something sees its own entry of the workers'
    /// metadata (`plan::worker_meta_entries`; restored afterwards).
    fn update_connector_output(
        &self,
        py: Python<'_>,
        connector_output: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let output = connector_output;
        self.core.step_done();
        if self.core.watching() {
            // Read only when there is something: the usual step has neither.
            let some = |v: Bound<'_, PyAny>| !v.is_none() && v.len().map_or(true, |n| n > 0);
            let invalid = output.getattr(intern!(py, "invalid_block_ids"))?;
            let invalid: HashSet<u32> = if some(invalid.clone()) {
                invalid.extract()?
            } else {
                HashSet::new()
            };
            let failed: HashSet<String> = match output.getattr(intern!(py, "failed_recving")) {
                Ok(f) if some(f.clone()) => f.extract()?,
                _ => HashSet::new(), // none, or a vLLM without failed_recving
            };
            if !invalid.is_empty() || !failed.is_empty() {
                self.core
                    .load_errors(|b| invalid.contains(&b), |r| failed.contains(r));
            }
        }
        if self.core.tracking_loads() {
            self.hold_completions(py, output)?;
        }
        let key = intern!(py, "kv_connector_worker_meta");
        let worker_meta = output.getattr(key)?;
        let entries =
            if worker_meta.is_none() {
                None
            } else {
                let children =
                    worker_meta
                        .getattr(intern!(py, "children"))
                        .ok()
                        .and_then(|c| c.cast_into::<PyTuple>().ok())
                        .ok_or_else(|| {
                            PyTypeError::new_err(format!(
                        "kvmux got worker metadata of type {}; the workers must run the same \
                         KvmuxConnector configuration",
                        worker_meta.get_type().name().map_or_else(|_| "?".into(), |n| n.to_string())
                    ))
                        })?;
                Some(children)
            };
        let told = worker_meta_entries(&self.update_output, entries.as_ref().map(|c| c.len()))
            .map_err(PyTypeError::new_err)?;
        let run = (|| -> PyResult<()> {
            for (i, entry) in told {
                if let (Some(children), Some(e)) = (&entries, entry) {
                    output.setattr(key, children.get_item(e)?)?;
                }
                if let Some(f) = self.update_output.call(i) {
                    f.bind(py)
                        .call1((output,))
                        .map_err(|e| self.child_error(py, hook::UPDATE_OUTPUT, i, e))?;
                }
            }
            Ok(())
        })();
        if entries.is_some() && self.update_output.any_active() {
            output.setattr(key, &worker_meta)?;
        }
        run
    }

    /// vLLM's `get_kv_connector_stats` (every step): None when there is
    /// nothing to report, else `stats_class(data)` (`KvmuxStats`; the dict
    /// itself without one), `data` being `{"children": {name: stats}}` with
    /// each child's stats that are not None, and `"kvmux"`: kvmux's
    /// counters, at most once per `stats_every_s` and whenever no request
    /// is live (the counts wait in the core until taken), at once when a
    /// breaker changed state (`"breaker_state"`).
    fn get_kv_connector_stats<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyAny>>> {
        let mut counters = match self.core.take_interval_every(self.stats_every) {
            Some(delta) if !delta.is_zero() => Some(super::counters_dict(
                py,
                &delta,
                true,
                self.core.clash_policy().as_str(),
                |i| self.core.name(i),
            )?),
            _ => None,
        };
        // With the interval's counters: what the load decision has learned
        // (gauges: the latest report wins).
        if let Some(counters) = &counters {
            if let Some(learned) = learned_dict(py, &self.core)? {
                counters.set_item(intern!(py, "load_decision"), learned)?;
            }
        }
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
        // The usual step: no child reports anything and kvmux's counters
        // are not due; nothing is built.
        if counters.is_none() && self.stats_all_none {
            return Ok(None);
        }
        let stats = self.answers(py, &self.child_stats, hook::STATS, |_, f| f.call0())?;
        let children = PyDict::new(py);
        for (i, s) in stats.into_iter().enumerate() {
            if !s.is_none() {
                children.set_item(self.core.name(i), s)?;
            }
        }
        if counters.is_none() && children.is_empty() {
            return Ok(None);
        }
        let data = PyDict::new(py);
        if let Some(counters) = counters {
            data.set_item(intern!(py, "kvmux"), counters)?;
        }
        data.set_item(intern!(py, "children"), children)?;
        match &self.stats_class {
            Some(cls) => cls.bind(py).call1((data,)).map(Some),
            None => Ok(Some(data.into_any())),
        }
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

    /// vLLM's `get_external_cache_hit_sources`: each child that supplied
    /// tokens of the request's load splits its own span (a child keeping
    /// vLLM's default split is not called: its span counts under its own
    /// source), summed by the core (`SchedulerMux::hit_sources`); vLLM's
    /// default for the multiplexer itself when no child loads.
    fn get_external_cache_hit_sources<'py>(
        &self,
        py: Python<'py>,
        request: &Bound<'py, PyAny>,
        num_external_tokens: u64,
    ) -> PyResult<Bound<'py, PyDict>> {
        let out = PyDict::new(py);
        let Some(src) = &self.sources else {
            return Ok(out);
        };
        if num_external_tokens == 0 {
            return Ok(out);
        }
        let rid = request_id(request)?;
        let req_id = str_key(&rid)?;
        let pairs = self.core.hit_sources::<String, PyErr>(
            &req_id,
            num_external_tokens,
            |i, span| match self.hit_split.call(i) {
                Some(f) => {
                    let got = f
                        .bind(py)
                        .call1((request, span))
                        .map_err(|e| self.child_error(py, hook::HIT_SOURCES, i, e))?;
                    Ok(src.pairs(py, &got))
                }
                None => Ok(None),
            },
            |i| src.own[i].clone(),
        )?;
        if pairs.is_empty() {
            out.set_item(src.default.bind(py), num_external_tokens)?;
            return Ok(out);
        }
        let by_value = src.by_value.bind(py);
        for (value, n) in pairs {
            let member = by_value
                .get_item(&value)?
                .ok_or_else(|| PyValueError::new_err(format!("unknown hit source {value:?}")))?;
            out.set_item(member, n)?;
        }
        Ok(out)
    }

    /// Cumulative counters: `{"children": {name: {...}}, "finished": n, ...,
    /// "live_requests": n, "breakers": {name: state}}`.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let out = super::counters_dict(
            py,
            &self.core.snapshot(),
            false,
            self.core.clash_policy().as_str(),
            |i| self.core.name(i),
        )?;
        out.set_item("live_requests", self.core.live_requests())?;
        let breakers = PyDict::new(py);
        for i in 0..self.core.n_children() {
            if let Some(state) = self.core.breaker(i) {
                breakers.set_item(self.core.name(i), state.as_str())?;
            }
        }
        out.set_item("breakers", breakers)?;
        out.set_item("save_table_blocks", self.core.save_table_len())?;
        if let Some(learned) = learned_dict(py, &self.core)? {
            out.set_item("load_decision", learned)?;
        }
        Ok(out)
    }

    /// Requests the multiplexer holds state for.
    fn __len__(&self) -> usize {
        self.core.live_requests()
    }
}

/// What the load decision has learned, as `{"compute_s_per_token": x,
/// "children": {name: {"load_s": a, "load_s_per_token": b,
/// "not_ready_wait_s": w}}}`, each key only once measured; None when
/// nothing is measured (`load_decision: "always"` without `timeline_path`).
fn learned_dict<'py>(py: Python<'py>, core: &SchedulerMux) -> PyResult<Option<Bound<'py, PyDict>>> {
    let Some(learned) = core.learned() else {
        return Ok(None);
    };
    let out = PyDict::new(py);
    if let Some(x) = learned.compute_per_token {
        out.set_item(intern!(py, "compute_s_per_token"), x)?;
    }
    let children = PyDict::new(py);
    for (i, (load, wait)) in learned.load.iter().zip(&learned.wait).enumerate() {
        let child = PyDict::new(py);
        if let Some(Some(y)) = learned.wait_yield.get(i) {
            child.set_item(intern!(py, "not_ready_yield_tokens"), y)?;
        }
        if let Some((per_request, per_token)) = load {
            child.set_item(intern!(py, "load_s"), per_request)?;
            child.set_item(intern!(py, "load_s_per_token"), per_token)?;
        }
        if let Some(w) = wait {
            child.set_item(intern!(py, "not_ready_wait_s"), w)?;
        }
        if !child.is_empty() {
            children.set_item(core.name(i), child)?;
        }
    }
    out.set_item(intern!(py, "children"), children)?;
    Ok(Some(out))
}

/// A finished request's timeline as the dict `timeline_path`'s lines hold
/// (see `kvmux.mux.timeline`).
fn timeline_dict<'py>(
    py: Python<'py>,
    core: &SchedulerMux,
    t: &Timeline,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("req_id", &t.req_id)?;
    d.set_item("arrival", t.arrival)?;
    d.set_item("prompt_tokens", t.prompt_tokens)?;
    d.set_item("first_lookup", t.first_lookup)?;
    d.set_item("lookup_calls", t.lookup_calls)?;
    d.set_item("ready", t.ready)?;
    d.set_item("local_hit_tokens", t.local_hit_tokens)?;
    let children = t
        .children
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let e = PyDict::new(py);
            e.set_item("name", core.name(i))?;
            e.set_item("not_ready", c.not_ready)?;
            e.set_item("not_ready_s", c.not_ready_s)?;
            e.set_item("tokens", c.tokens)?;
            e.set_item("declined", c.declined.map(|w| w.as_str()))?;
            e.set_item("load_tokens", c.load_tokens)?;
            e.set_item("load_async", c.load_async)?;
            e.set_item("load_start", c.load_start)?;
            e.set_item("load_done", c.load_done)?;
            e.set_item("save_declined", c.save_declined.map(|w| w.as_str()))?;
            Ok(e)
        })
        .collect::<PyResult<Vec<_>>>()?;
    d.set_item("children", children)?;
    d.set_item("allocated", t.allocated)?;
    d.set_item("external_tokens", t.external_tokens)?;
    d.set_item("first_token", t.first_token)?;
    d.set_item("finished", t.finished)?;
    Ok(d)
}

/// A child's `save_policy`: `"always"`, `"auto"` or a reuse threshold (an
/// int of at least 1).
fn save_policy(v: &Bound<'_, PyAny>) -> PyResult<admit::Policy> {
    let got = if let Ok(s) = v.extract::<String>() {
        admit::Policy::parse(&s)
    } else if v.is_instance_of::<pyo3::types::PyBool>() {
        None
    } else {
        v.extract::<u32>().ok().and_then(admit::Policy::reuse)
    };
    got.ok_or_else(|| {
        PyValueError::new_err(format!(
            "save_policy must be one of {:?} or a reuse threshold (an int >= 1), got {v}",
            admit::SAVE_POLICIES
        ))
    })
}

/// A request's block hashes as the core counts them: the first 8 bytes of
/// each (vLLM's `BlockHash` is bytes; another object's Python hash).
fn block_hashes(py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
    let Ok(list) = request.getattr(intern!(py, "block_hashes")) else {
        return Ok(Vec::new());
    };
    let mut out = Vec::with_capacity(list.len().unwrap_or(0));
    for h in list.try_iter()? {
        let h = h?;
        let v = match h.cast::<pyo3::types::PyBytes>() {
            Ok(b) => {
                let b = b.as_bytes();
                let mut x = [0u8; 8];
                let k = b.len().min(8);
                x[..k].copy_from_slice(&b[..k]);
                u64::from_le_bytes(x)
            }
            Err(_) => h.hash()? as u64,
        };
        out.push(v);
    }
    Ok(out)
}

/// Whether the request's `kv_transfer_params` ask for a save (P/D's
/// `do_remote_decode`): then no child's save of it is declined.
fn asks_save(py: Python<'_>, request: &Bound<'_, PyAny>) -> PyResult<bool> {
    let Ok(params) = request.getattr(intern!(py, "kv_transfer_params")) else {
        return Ok(false);
    };
    let Ok(params) = params.cast::<PyDict>() else {
        return Ok(false);
    };
    match params.get_item(intern!(py, "do_remote_decode"))? {
        Some(v) => v.is_truthy(),
        None => Ok(false),
    }
}
