"""Parse and validate ``kv_connector_extra_config`` of a ``KvmuxConnector``.

Every check raises :class:`KvmuxConfigError` (a ``ValueError``) naming the
key, value or child and the fix; all problems found are reported at once.
Nothing here uses ``assert``, so ``python -O`` changes nothing.
"""

from __future__ import annotations

import copy
import difflib
import functools
import importlib
import importlib.metadata
import inspect
import math
import types
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmux._core import (
    CLASH_POLICIES,
    LOAD_DECISIONS,
    LOAD_POLICIES,
    MAX_CHILDREN,
    SAVE_POLICIES,
    check_breaker,
    check_deadline,
    hma_refusal,
)
from kvmux.errors import KvmuxConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["BreakerSpec", "ChildSpec", "MuxConfig", "parse_mux_config"]

#: How long a child may answer a lookup "not ready" before kvmux treats it
#: as a miss for that request (ms; global here, or per child in its entry).
LOOKUP_TIMEOUT_KEY = "lookup_timeout_ms"
#: How long a child's asynchronous load may stay unfinished before kvmux
#: fails it for the request (ms; global here, or per child in its entry).
LOAD_TIMEOUT_KEY = "load_timeout_ms"
#: The circuit breaker of each child (global here, or per child in its
#: entry): this many consecutive failed lookups (deadline missed, or raised)
#: open it (None: no breaker; a raising lookup then fails the call) ...
BREAKER_FAILURES_KEY = "breaker_failures"
#: ... for this long (ms), doubled by each failed probe ...
BREAKER_COOLDOWN_KEY = "breaker_cooldown_ms"
#: ... up to this long (ms).
BREAKER_MAX_COOLDOWN_KEY = "breaker_max_cooldown_ms"
BREAKER_KEYS = (BREAKER_FAILURES_KEY, BREAKER_COOLDOWN_KEY, BREAKER_MAX_COOLDOWN_KEY)
DEFAULT_BREAKER_FAILURES = 3
DEFAULT_BREAKER_COOLDOWN_MS = 1000.0
DEFAULT_BREAKER_MAX_COOLDOWN_MS = 30000.0
#: The bounds of the deadline and breaker settings are the core's
#: (``rust/mux/settings.rs``: ``_core.check_deadline``, ``_core.check_breaker``);
#: this module checks types and defaults, and words the refusal.
#: Display names kvmux's own reports already use: vLLM's prefix cache in
#: ``cached_tokens_by_child``, and kvmux itself in clash errors.
RESERVED_NAMES = ("local_prefix_cache", "kvmux")
#: Tells vLLM that a child allocates the KV cache from its own memory pool
#: (vLLM 0.34 reads it only at the top level under a name other than
#: ``MultiConnector``: see :mod:`kvmux.mux.parent_name`); kvmux only passes it on.
CUSTOM_MEM_POOL_KEY = "custom_mem_pool"
#: ``"always"`` (default): a child's hit is loaded whatever it costs;
#: ``"cost"``: kvmux learns what each child's load (and its "not ready"
#: wait) costs and what computing a prompt token costs on this instance,
#: and takes a span only when loading it is expected to be faster
#: (``rust/mux/cost.rs``; docs/configuration.md, "The load decision").
LOAD_DECISION_KEY = "load_decision"
DEFAULT_LOAD_DECISION = "always"
#: A file the scheduler side appends one JSON line to per finished request:
#: where its time went (:mod:`kvmux.mux.timeline`).
TIMELINE_PATH_KEY = "timeline_path"
ALLOWED_KEYS = (
    "connectors",
    "clash_policy",
    "load_policy",
    LOAD_DECISION_KEY,
    TIMELINE_PATH_KEY,
    LOOKUP_TIMEOUT_KEY,
    LOAD_TIMEOUT_KEY,
    *BREAKER_KEYS,
    CUSTOM_MEM_POOL_KEY,
)
#: Optional per-child display name (stats, metrics, errors); kvmux removes it
#: before vLLM parses the child's kv_transfer_config.
NAME_KEY = "name"
#: ``load_policy: "compose"``: a child entry's ``true`` declares that the
#: child loads only the span after the ``num_computed_tokens`` its lookup was
#: given, so it may follow other children.
SPANS_KEY = "loads_spans"
#: Children measured to load a span correctly (``tests/mux/test_compose.py``);
#: any other may only be the first child under ``compose``, unless its
#: entry sets :data:`SPANS_KEY`.
SPAN_LOADERS = ("KvmuxHostCache", "LMCacheMPConnector")
#: Children measured to write outside their span (why, for the refusal).
NOT_SPAN_LOADERS = {
    "ExampleConnector": "it writes every block of its stored prefix, over the span the "
    'children before it loaded (measured: kvmux\'s docs/configuration.md, "Composing tiers")',
}
#: A child entry's save admission (``rust/mux/admit.rs``; docs/configuration.md,
#: "Save admission"): ``"always"`` (every save, as vLLM's MultiConnector),
#: ``"auto"`` (the default; kvmux's rule: every save for the first storage
#: tier; for the others
#: only a request with a block they lack that was seen by
#: ``_core.DEFAULT_REUSE`` requests or read back from a tier) or a reuse
#: threshold (an int >= 1, for this child whatever its place).
SAVE_POLICY_KEY = "save_policy"
DEFAULT_SAVE_POLICY = "auto"
#: Children that are P/D transports, not storage tiers: they send only what
#: a request's ``kv_transfer_params`` ask for (never declined), and under
#: ``"auto"`` the first storage tier is the first child not listed here (nor
#: a ``kv_consumer``, which never saves). vLLM 0.32-0.34's registry names
#: NIXL three ways (pull, push, and the name both answer to).
TRANSPORTS = (
    "NixlConnector",
    "NixlPullConnector",
    "NixlPushConnector",
    "P2pNcclConnector",
    "MooncakeConnector",
    "MoRIIOConnector",
)
#: The keys of a child's entry that are kvmux's, not the child's.
CHILD_KEYS = (
    NAME_KEY,
    LOOKUP_TIMEOUT_KEY,
    LOAD_TIMEOUT_KEY,
    *BREAKER_KEYS,
    SPANS_KEY,
    SAVE_POLICY_KEY,
)
DEFAULT_CLASH_POLICY = "error"
DEFAULT_LOAD_POLICY = "first"


@dataclass(frozen=True)
class BreakerSpec:
    """A child's circuit breaker (see the README's "A slow or dead child")."""

    failures: int = DEFAULT_BREAKER_FAILURES
    """Consecutive failed lookups (deadline missed, or raised) that open it."""
    cooldown_ms: float = DEFAULT_BREAKER_COOLDOWN_MS
    """How long it stays open at first; each failed probe doubles it."""
    max_cooldown_ms: float = DEFAULT_BREAKER_MAX_COOLDOWN_MS
    """The longest cooldown."""


#: The breaker every child has unless configured otherwise.
DEFAULT_BREAKER = BreakerSpec()


@dataclass(frozen=True)
class ChildSpec:
    """One child connector as configured."""

    index: int
    name: str
    """Unique display name: the child's ``name`` if given, else its class name
    (with ``#index`` when the class repeats or a given name takes it)."""
    transfer_config: KVTransferConfig
    cls: type[KVConnectorBase_V1]
    supports_hma: bool
    lookup_timeout_ms: float | None = None
    """How long the child may answer a lookup "not ready" (None: no limit)."""
    breaker: BreakerSpec | None = DEFAULT_BREAKER
    """The child's circuit breaker (None: none)."""
    load_timeout_ms: float | None = None
    """How long an async load of the child may stay unfinished before it is
    failed for the request (None: no limit)."""
    save_policy: str | int = DEFAULT_SAVE_POLICY
    """``"always"``, ``"auto"`` or a reuse threshold (:data:`SAVE_POLICY_KEY`)."""
    transport: bool = False
    """A P/D transport, not a storage tier (:data:`TRANSPORTS`)."""

    def vllm_config_for(self, vllm_config: VllmConfig) -> VllmConfig:
        """The parent's ``VllmConfig`` with this child's transfer config (for
        vLLM's ``ExampleConnector``, its storage path made this model's own:
        :mod:`kvmux.mux.example_storage`)."""
        from kvmux.mux.example_storage import per_model_transfer_config

        child = copy.copy(vllm_config)
        child.kv_transfer_config = per_model_transfer_config(
            self.cls, self.transfer_config, vllm_config
        )
        return child


@dataclass(frozen=True)
class MuxConfig:
    children: tuple[ChildSpec, ...]
    clash_policy: str
    load_policy: str
    load_decision: str = DEFAULT_LOAD_DECISION
    """``"always"`` or ``"cost"`` (:data:`LOAD_DECISION_KEY`)."""
    timeline_path: str | None = None
    """Where finished requests' timelines go (:data:`TIMELINE_PATH_KEY`)."""

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.children]

    @functools.cached_property
    def all_support_hma(self) -> bool:
        return all(c.supports_hma for c in self.children)

    def non_hma_children(self) -> list[str]:
        return [c.name for c in self.children if not c.supports_hma]


def _suggest(word: str, choices: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(word, choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _policy(
    extra: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str, problems: list[str]
) -> str:
    value = extra.get(key, default)
    if not isinstance(value, str) or value not in choices:
        problems.append(
            f"{key}={value!r} is not valid{_suggest(str(value), choices)}; "
            f"set kv_connector_extra_config[{key!r}] to one of {list(choices)} "
            f"(default {default!r})"
        )
        return default
    return value


@dataclass(frozen=True)
class _RawChild:
    index: int
    cls_name: str
    name: str | None
    transfer_config: KVTransferConfig
    cls: type[KVConnectorBase_V1]
    lookup_timeout_ms: float | None
    breaker: BreakerSpec | None
    loads_spans: bool
    load_timeout_ms: float | None = None
    save_policy: str | int = DEFAULT_SAVE_POLICY


#: What each deadline key bounds (for the refusal's fix).
_TIMEOUT_MEANS = {
    LOOKUP_TIMEOUT_KEY: "a child may answer a lookup 'not ready' before kvmux treats it as "
    "a miss (a number > 0, e.g. 2000)",
    LOAD_TIMEOUT_KEY: "a child's asynchronous load may stay unfinished before kvmux fails "
    "it for the request, which vLLM then recomputes or fails by its "
    "kv_load_failure_policy (a number > 0, e.g. 10000)",
}


def _timeout(
    raw: Mapping[str, Any], where: str, problems: list[str], key: str = LOOKUP_TIMEOUT_KEY
) -> float | None:
    """``key`` (``lookup_timeout_ms`` or ``load_timeout_ms``) of ``raw``
    (None when absent); a problem when it is not a number of milliseconds
    within the core's bounds."""
    value = raw.get(key)
    if value is None:
        return None
    # A value of the wrong type stands in as one out of bounds (same rule).
    bad = check_deadline(key, _ms(value))
    if bad is not None:
        problems.append(
            f"{where}{key}={value!r} is not valid; set it to the milliseconds "
            f"{_TIMEOUT_MEANS[key]}: {bad[1]}; or leave it out for no deadline"
        )
        return None
    return _ms(value)


#: What each breaker key means (for the refusal's fix).
_BREAKER_MEANS = {
    BREAKER_FAILURES_KEY: "how many consecutive failed lookups (deadline missed, or raised) "
    f"open the child's breaker (default {DEFAULT_BREAKER_FAILURES}; null: no breaker)",
    BREAKER_COOLDOWN_KEY: "how long an open breaker waits before it lets one lookup probe "
    f"the child (default {DEFAULT_BREAKER_COOLDOWN_MS:g})",
    BREAKER_MAX_COOLDOWN_KEY: "the longest cooldown, which each failed probe doubles toward "
    f"(default {DEFAULT_BREAKER_MAX_COOLDOWN_MS:g})",
}

#: Python ints beyond the core's u64 are out of bounds anyway: passed clamped.
_U64_MAX = (1 << 64) - 1


def _breaker(
    raw: Mapping[str, Any],
    where: str,
    problems: list[str],
    default: BreakerSpec | None = DEFAULT_BREAKER,
) -> BreakerSpec | None:
    """The breaker settings of ``raw`` over ``default`` (a key present in
    ``raw`` wins; ``breaker_failures: null`` turns the breaker off)."""
    if not any(k in raw for k in BREAKER_KEYS):
        return default
    base = default or BreakerSpec()
    # Inherited when absent: a breaker turned off stays off.
    failures = raw.get(BREAKER_FAILURES_KEY, default and default.failures)
    values = {
        BREAKER_FAILURES_KEY: failures,
        BREAKER_COOLDOWN_KEY: raw.get(BREAKER_COOLDOWN_KEY, base.cooldown_ms),
        BREAKER_MAX_COOLDOWN_KEY: raw.get(BREAKER_MAX_COOLDOWN_KEY, base.max_cooldown_ms),
    }
    if BREAKER_MAX_COOLDOWN_KEY not in raw and _is_number(values[BREAKER_COOLDOWN_KEY]):
        # An inherited longest cooldown follows a first one set above it.
        values[BREAKER_MAX_COOLDOWN_KEY] = max(
            values[BREAKER_MAX_COOLDOWN_KEY], values[BREAKER_COOLDOWN_KEY]
        )
    # The core's rule decides; a value of the wrong type stands in as one
    # out of its bounds, so its refusal names the same rule.
    if failures is None:
        count = 1  # no breaker: its cooldowns are still checked
    elif isinstance(failures, bool) or not isinstance(failures, int):
        count = 0
    else:
        count = min(max(failures, 0), _U64_MAX)
    ms = {k: _ms(values[k]) for k in (BREAKER_COOLDOWN_KEY, BREAKER_MAX_COOLDOWN_KEY)}
    bad = check_breaker(count, ms[BREAKER_COOLDOWN_KEY], ms[BREAKER_MAX_COOLDOWN_KEY])
    if bad is not None:
        key, rule = bad
        problems.append(
            f"{where}{key}={values[key]!r} is not valid; set it to {_BREAKER_MEANS[key]}: {rule}"
        )
        return None
    if failures is None:
        return None
    return BreakerSpec(
        failures=failures,
        cooldown_ms=ms[BREAKER_COOLDOWN_KEY],
        max_cooldown_ms=ms[BREAKER_MAX_COOLDOWN_KEY],
    )


def _is_number(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float)


def _ms(value: Any) -> float:
    """``value`` as the float the core checks: NaN (out of every bound) for
    a value that is not a number, infinity for an int too large for one."""
    if not _is_number(value):
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf


#: What vLLM's built-in ``LMCacheMPConnector`` (``LMCACHE_USE_UPSTREAM_MP=1``)
#: passes its scheduler adapter (vLLM 0.33 and 0.34), and the module that
#: holds it (by default it resolves ``LMCacheMPConnector`` to lmcache's class).
_BUILTIN_LMCACHE_MP = "vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector"
_BUILTIN_ADAPTER_KEY = "server_url"


@functools.cache
def _reads_attribute(cls: type, attr: str) -> bool:
    """Whether a method of ``cls`` or its bases reads ``.attr`` directly (an
    attribute load in its bytecode; ``getattr(x, "attr", default)`` is not)."""

    def names(code: types.CodeType) -> Iterator[str]:
        yield from code.co_names
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                yield from names(const)

    for klass in cls.__mro__[:-1]:  # object aside
        for v in vars(klass).values():
            fn = getattr(v, "__func__", None) or getattr(v, "fget", None) or v
            code = getattr(fn, "__code__", None)
            if isinstance(code, types.CodeType) and attr in names(code):
                return True
    return False


def _builtin_lmcache_mp_error() -> str | None:
    """Why vLLM's built-in ``LMCacheMPConnector`` cannot start with the
    installed lmcache (None: it can, as far as its signature tells): it
    builds lmcache's ``LMCacheMPSchedulerAdapter`` with ``server_url=``,
    which lmcache 0.5.6 renamed ``server_urls`` (a TypeError at start-up)."""
    try:
        adapter = importlib.import_module(_BUILTIN_LMCACHE_MP).LMCacheMPSchedulerAdapter
        params = inspect.signature(adapter).parameters
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    if _BUILTIN_ADAPTER_KEY in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return None
    return (
        f"it builds {adapter.__module__}.{adapter.__qualname__} with "
        f"{_BUILTIN_ADAPTER_KEY}=, which that class does not take"
    )


def _version(module: str) -> str:
    dist = module.partition(".")[0]
    try:
        return f"{dist} {importlib.metadata.version(dist)}"
    except importlib.metadata.PackageNotFoundError:
        return dist


def known_crash(cls: type, ktc: KVTransferConfig, where: str) -> str | None:
    """The refusal (naming the versions, why and the fix) for a child class
    known to crash on the installed vLLM; None for any other. Decided by
    what the class and this vLLM can do, not by version strings: lmcache
    0.5.6's ``LMCacheMPConnector`` reads ``CachedRequestData.resumed_req_ids``
    on every step with a running request, which vLLM 0.34 removed
    (:data:`kvmux._versions.HAS_RESUMED_REQ_IDS`); vLLM's built-in copy
    cannot start with lmcache 0.5.6's adapter."""
    import vllm

    from kvmux import _versions

    vv, path = f"vLLM {vllm.__version__}", f"{cls.__module__}.{cls.__qualname__}"
    if cls.__module__ == _BUILTIN_LMCACHE_MP and (builtin := _builtin_lmcache_mp_error()):
        lv = _version("lmcache")
        fix = (
            "unset LMCACHE_USE_UPSTREAM_MP in the vLLM server's environment (lmcache's own "
            f"LMCacheMPConnector works on {vv})"
            if _versions.HAS_RESUMED_REQ_IDS
            else f"upgrade lmcache to a release that supports {vv}, or run vLLM 0.33 with "
            f"{lv} (unset LMCACHE_USE_UPSTREAM_MP there)"
        )
        return (
            f"{where} resolves to vLLM's built-in {path} (LMCACHE_USE_UPSTREAM_MP is set), "
            f"which fails at start-up with {lv} (a TypeError: {builtin}); {fix}"
        )
    if _versions.HAS_RESUMED_REQ_IDS or not _reads_attribute(cls, "resumed_req_ids"):
        return None
    dist = _version(cls.__module__)
    if cls.__name__ != "LMCacheMPConnector":
        fix = f"upgrade {dist.split(' ')[0]} to a release that supports {vv}"
    elif (builtin := _builtin_lmcache_mp_error()) is None:
        fix = (
            "set LMCACHE_USE_UPSTREAM_MP=1 in the vLLM server's environment"
            + (" and drop kv_connector_module_path" if ktc.kv_connector_module_path else "")
            + " to use vLLM's built-in LMCacheMPConnector, or upgrade lmcache to a release "
            f"that supports {vv}"
        )
    else:
        fix = (
            f"upgrade lmcache to a release that supports {vv}, or run vLLM 0.33 with {dist} "
            f"(its LMCacheMPConnector works there); LMCACHE_USE_UPSTREAM_MP=1 does not help "
            f"with {dist}: vLLM's built-in LMCacheMPConnector then fails at start-up "
            f"(a TypeError: {builtin})"
        )
    return (
        f"{where} resolves to {path} ({dist}), which reads "
        "scheduler_output.scheduled_cached_reqs.resumed_req_ids in build_connector_meta on "
        f"every step with a running request; {vv}'s CachedRequestData has no such field "
        "(removed in vLLM 0.34), so it would crash the engine mid-serving, as soon "
        f"as a request runs a second step (its first decode); {fix}"
    )


@functools.cache
def lmcache_refusal() -> str | None:
    """kvmux's start-up refusal of LMCache's ``LMCacheMPConnector``, as
    vLLM's factory resolves it on the installed vLLM, LMCache and
    environment (:func:`known_crash`), or None where it runs (lmcache 0.5.6
    runs on vLLM 0.32 and 0.33, not on 0.34). Imports LMCache: seconds."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    ktc = KVTransferConfig(kv_connector="LMCacheMPConnector", kv_role="kv_both")
    return known_crash(KVConnectorFactory.get_connector_class(ktc), ktc, "LMCacheMPConnector")


def _child(
    index: int,
    raw: Any,
    parent: KVTransferConfig,
    problems: list[str],
    default_timeout: float | None = None,
    default_breaker: BreakerSpec | None = DEFAULT_BREAKER,
    default_load_timeout: float | None = None,
) -> _RawChild | None:
    from vllm.config.kv_transfer import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    where = f"connectors[{index}]"
    if not isinstance(raw, Mapping):
        problems.append(
            f"{where} is a {type(raw).__name__}, not a dict; each child is a "
            'kv_transfer_config dict such as {"kv_connector": "ExampleConnector", '
            '"kv_role": "kv_both"}'
        )
        return None
    cls_name = raw.get("kv_connector")
    if not isinstance(cls_name, str) or not cls_name:
        problems.append(
            f"{where} has no 'kv_connector' class name; add e.g. "
            '"kv_connector": "LMCacheMPConnector"'
        )
        return None
    where = f"{where} ({cls_name})"
    name = raw.get(NAME_KEY)
    if name is not None and (not isinstance(name, str) or not name.strip()):
        problems.append(f"{where}: {NAME_KEY!r} must be a non-empty string, got {name!r}")
        return None
    fields = {
        "kv_role": parent.kv_role,
        "kv_buffer_device": parent.kv_buffer_device,
        **{k: v for k, v in raw.items() if k not in CHILD_KEYS},
        "engine_id": raw.get("engine_id", parent.engine_id),
    }
    try:
        ktc = KVTransferConfig(**fields)
    except Exception as e:  # pydantic / vLLM validation: report, do not crash
        problems.append(f"{where} is not a valid kv_transfer_config: {e}")
        return None
    try:
        cls = KVConnectorFactory.get_connector_class(ktc)
    except Exception as e:
        path = raw.get("kv_connector_module_path")
        fix = (
            f"check that module {path!r} is installed and defines {cls_name}"
            if path
            else "use a connector name vLLM registers (e.g. ExampleConnector, "
            "LMCacheMPConnector, NixlConnector) or set kv_connector_module_path"
        )
        problems.append(f"{where} cannot be loaded ({type(e).__name__}: {e}); {fix}")
        return None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        problems.append(f"{where} resolves to {cls!r}, which is not a KVConnectorBase_V1 subclass")
        return None
    crash = known_crash(cls, ktc, where)  # a class known to crash on this vLLM
    if crash is not None:
        problems.append(crash)
        return None
    # kvmux's own connectors check their settings here, so every problem is
    # found before anything is built (and by `python -m kvmux doctor`).
    validate = getattr(cls, "validate_transfer_config", None)
    if callable(validate):
        try:
            validate(ktc)
        except KvmuxConfigError as e:
            problems.extend(f"{where}: {p}" for p in e.problems)
            return None
    own_timeout = _timeout(raw, f"{where}: ", problems)
    timeout = own_timeout if LOOKUP_TIMEOUT_KEY in raw else default_timeout
    own_load = _timeout(raw, f"{where}: ", problems, LOAD_TIMEOUT_KEY)
    load_timeout = own_load if LOAD_TIMEOUT_KEY in raw else default_load_timeout
    breaker = _breaker(raw, f"{where}: ", problems, default_breaker)
    spans = raw.get(SPANS_KEY, cls_name in SPAN_LOADERS)
    if not isinstance(spans, bool):
        problems.append(f"{where}: {SPANS_KEY!r} must be true or false, got {spans!r}")
        return None
    save_policy = _save_policy(raw, where, problems)
    if save_policy is None:
        return None
    return _RawChild(
        index, cls_name, name, ktc, cls, timeout, breaker, spans, load_timeout, save_policy
    )


def _save_policy(raw: Mapping[str, Any], where: str, problems: list[str]) -> str | int | None:
    """A child entry's ``save_policy`` (the default when absent); None and a
    problem when it is neither one of ``SAVE_POLICIES`` nor an int >= 1."""
    value = raw.get(SAVE_POLICY_KEY, DEFAULT_SAVE_POLICY)
    if isinstance(value, str) and value in SAVE_POLICIES:
        return value
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= 0xFFFFFFFF:
        return value
    problems.append(
        f"{where}: {SAVE_POLICY_KEY}={value!r} is not valid"
        f'{_suggest(str(value), tuple(SAVE_POLICIES))}; set it to "always" (every save, '
        "as vLLM's MultiConnector), \"auto\" (kvmux's rule: every save for the first child, "
        "for the others only blocks seen by 2 requests or read back) or a reuse threshold "
        f"(an int >= 1), or leave it out (default {DEFAULT_SAVE_POLICY!r})"
    )
    return None


def parse_mux_config(kv_transfer_config: KVTransferConfig) -> MuxConfig:
    """Validate a ``KvmuxConnector``'s transfer config; raise
    :class:`KvmuxConfigError` listing every problem."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    extra = kv_transfer_config.kv_connector_extra_config
    problems: list[str] = []
    if not isinstance(extra, Mapping):
        raise KvmuxConfigError(
            f"kv_connector_extra_config is a {type(extra).__name__}; it must be a dict "
            'with a "connectors" list'
        )
    for key in extra:
        if key not in ALLOWED_KEYS:
            problems.append(
                f"unknown key {key!r} in kv_connector_extra_config"
                f"{_suggest(str(key), ALLOWED_KEYS)}; allowed keys are {list(ALLOWED_KEYS)}"
            )
    clash = _policy(extra, "clash_policy", tuple(CLASH_POLICIES), DEFAULT_CLASH_POLICY, problems)
    load = _policy(extra, "load_policy", tuple(LOAD_POLICIES), DEFAULT_LOAD_POLICY, problems)
    decision = _policy(
        extra, LOAD_DECISION_KEY, tuple(LOAD_DECISIONS), DEFAULT_LOAD_DECISION, problems
    )
    timeline = extra.get(TIMELINE_PATH_KEY)
    if timeline is not None and (not isinstance(timeline, str) or not timeline):
        problems.append(
            f"kv_connector_extra_config: {TIMELINE_PATH_KEY}={timeline!r} must be a file path "
            "(a non-empty string) that the scheduler process can append to, or left out"
        )
        timeline = None
    elif timeline is not None:
        from kvmux.mux.timeline import timeline_problem

        why = timeline_problem(timeline)
        if why:
            problems.append(f"kv_connector_extra_config: {TIMELINE_PATH_KEY}={timeline!r}: {why}")
            timeline = None
    default_timeout = _timeout(extra, "kv_connector_extra_config: ", problems)
    default_load_timeout = _timeout(
        extra, "kv_connector_extra_config: ", problems, LOAD_TIMEOUT_KEY
    )
    default_breaker = _breaker(extra, "kv_connector_extra_config: ", problems)
    pool = extra.get(CUSTOM_MEM_POOL_KEY, False)
    if not isinstance(pool, bool):
        problems.append(
            f"kv_connector_extra_config: {CUSTOM_MEM_POOL_KEY}={pool!r} must be true or false "
            "(true when a child allocates the KV cache from its own memory pool)"
        )

    raw_children = extra.get("connectors")
    children: list[_RawChild] = []
    if raw_children is None:
        problems.append(
            'kv_connector_extra_config has no "connectors" list; add one child '
            'kv_transfer_config per connector, e.g. "connectors": [{"kv_connector": '
            '"KvmuxHostCache", "kv_connector_module_path": "kvmux", "kv_role": "kv_both"}]'
        )
    elif not isinstance(raw_children, list | tuple):
        problems.append(
            f'"connectors" is a {type(raw_children).__name__}; it must be a list of '
            "child kv_transfer_config dicts"
        )
    elif not raw_children:
        problems.append('"connectors" is empty; list at least one child connector')
    elif len(raw_children) > MAX_CHILDREN:
        problems.append(
            f'"connectors" lists {len(raw_children)} children; kvmux runs at most {MAX_CHILDREN}'
        )
    else:
        for i, raw in enumerate(raw_children):
            got = _child(
                i,
                raw,
                kv_transfer_config,
                problems,
                default_timeout,
                default_breaker,
                default_load_timeout,
            )
            if got is not None:
                children.append(got)
    names = _names(children, problems)
    if kv_transfer_config.kv_connector == "MultiConnector" and isinstance(raw_children, list):
        # vLLM builds each child's KVTransferConfig itself under this name
        # (its HMA check) and refuses any key it does not know.
        problems.extend(
            f"connectors[{i}] sets {k!r}, which vLLM refuses under the connector name "
            '"MultiConnector" (it parses each child entry itself); set it in '
            "kv_connector_extra_config for every child instead, or name the connector "
            '"KvmuxConnector"'
            for i, raw in enumerate(raw_children)
            if isinstance(raw, Mapping)
            for k in CHILD_KEYS
            if k in raw
        )
    if load == "compose":
        problems.extend(
            f"connectors[{c.index}] ({c.cls_name}) is not known to load a span of a prefix "
            "(one that starts after what the children before it supply), so under "
            'load_policy "compose" it can only be connectors[0]; move it first, or set '
            f'"{SPANS_KEY}": true in its entry if it loads from the num_computed_tokens its '
            f"get_num_new_matched_tokens was given (measured to: {', '.join(SPAN_LOADERS)})"
            + (
                f"; {c.cls_name} was measured NOT to: {NOT_SPAN_LOADERS[c.cls_name]}"
                if c.cls_name in NOT_SPAN_LOADERS
                else ""
            )
            for c in children[1:]
            if not c.loads_spans
        )
    if problems:
        raise KvmuxConfigError(problems)
    specs = tuple(
        ChildSpec(
            index=c.index,
            name=name,
            transfer_config=c.transfer_config,
            cls=c.cls,
            supports_hma=KVConnectorFactory.supports_hma_config(c.transfer_config),
            lookup_timeout_ms=c.lookup_timeout_ms,
            breaker=c.breaker,
            load_timeout_ms=c.load_timeout_ms,
            save_policy=c.save_policy,
            transport=c.cls_name in TRANSPORTS or c.transfer_config.kv_role == "kv_consumer",
        )
        for c, name in zip(children, names, strict=True)
    )
    return MuxConfig(
        children=specs,
        clash_policy=clash,
        load_policy=load,
        load_decision=decision,
        timeline_path=timeline,
    )


def _names(children: list[_RawChild], problems: list[str]) -> list[str]:
    """Display names: the given ``name``, else the class name (with ``#index``
    when several children share the class or a given name is that class
    name). Given names must be unique."""
    given: dict[str, int] = {}
    for c in children:
        if c.name is not None:
            if c.name in RESERVED_NAMES:
                problems.append(
                    f"connectors[{c.index}] sets {NAME_KEY} {c.name!r}, which kvmux's own "
                    f"reports use ({', '.join(map(repr, RESERVED_NAMES))}); give it another "
                    f"{NAME_KEY}"
                )
            if c.name in given:
                problems.append(
                    f"connectors[{given[c.name]}] and connectors[{c.index}] share the "
                    f"{NAME_KEY} {c.name!r}; give each child a distinct {NAME_KEY}"
                )
            given[c.name] = c.index
    counts: dict[str, int] = {}
    for c in children:
        counts[c.cls_name] = counts.get(c.cls_name, 0) + 1
    names = [
        c.name
        if c.name is not None
        else c.cls_name
        if counts[c.cls_name] == 1 and c.cls_name not in given and c.cls_name not in RESERVED_NAMES
        else f"{c.cls_name}#{c.index}"
        for c in children
    ]
    # A given name may equal one kvmux makes for another child (AdvConnector#1).
    owner: dict[str, _RawChild] = {}
    for c, name in zip(children, names, strict=True):
        other = owner.setdefault(name, c)
        if other is not c and (other.name is None or c.name is None):
            named, made = (c, other) if c.name is not None else (other, c)
            problems.append(
                f"connectors[{named.index}] is named {name!r}, the name kvmux gives "
                f"connectors[{made.index}] ({made.cls_name}); give connectors[{named.index}] "
                f"another {NAME_KEY}"
            )
    return names


def num_kv_cache_groups(kv_cache_config: KVCacheConfig | None) -> int | None:
    """How many KV cache groups the model has (None: not known)."""
    if kv_cache_config is None:
        return None
    return len(kv_cache_config.kv_cache_groups)


def check_hma(cfg: MuxConfig, hma_enabled: bool, kv_cache_config: KVCacheConfig | None) -> None:
    """Refuse a model whose KV a child cannot follow.

    Decided from the model, not from the flag: with the hybrid KV cache
    manager on and one KV cache group (every plain model: Llama, Qwen,
    Mistral without interleaved sliding window) a child without HMA support
    sees exactly what it would with the manager off, one group and one block
    list, so every child runs. With several groups, each child that lacks HMA
    support is named, with the group count and both fixes. The scheduler and
    the workers are built with the same ``KVCacheConfig`` and decide alike.
    """
    if not hma_enabled:
        return
    refusal = hma_refusal(
        [c.supports_hma for c in cfg.children],
        [c.name for c in cfg.children],
        num_kv_cache_groups(kv_cache_config),
    )
    if refusal is not None:
        raise KvmuxConfigError(refusal)
