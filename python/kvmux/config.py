"""Parse and validate ``kv_connector_extra_config`` of a ``KvmuxConnector``.

Every check raises :class:`KvmuxConfigError` (a ``ValueError``) naming the
key, value or child and the fix; all problems found are reported at once.
Nothing here uses ``assert``, so ``python -O`` changes nothing.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmux._core import CLASH_POLICIES, LOAD_POLICIES, MAX_CHILDREN
from kvmux.errors import KvmuxConfigError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig

__all__ = ["ChildSpec", "MuxConfig", "parse_mux_config"]

ALLOWED_KEYS = ("connectors", "clash_policy", "load_policy")
DEFAULT_CLASH_POLICY = "error"
DEFAULT_LOAD_POLICY = "first"
HMA_FIX = (
    "pass --disable-hybrid-kv-cache-manager (VllmConfig: "
    "scheduler_config.disable_hybrid_kv_cache_manager=True), or name the "
    'connector "MultiConnector" with kv_connector_module_path "kvmux" so vLLM '
    "turns the hybrid manager off by itself"
)


@dataclass(frozen=True)
class ChildSpec:
    """One child connector as configured."""

    index: int
    name: str
    """Unique display name: the class name, with ``#index`` when repeated."""
    transfer_config: KVTransferConfig
    cls: type
    supports_hma: bool

    def vllm_config_for(self, vllm_config: VllmConfig) -> VllmConfig:
        """The parent's ``VllmConfig`` with this child's transfer config."""
        child = copy.copy(vllm_config)
        child.kv_transfer_config = self.transfer_config
        return child


@dataclass(frozen=True)
class MuxConfig:
    children: tuple[ChildSpec, ...]
    clash_policy: str
    load_policy: str

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.children]

    @property
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


def _child(
    index: int, raw: Any, parent: KVTransferConfig, problems: list[str]
) -> tuple[str, KVTransferConfig, type] | None:
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
    name = raw.get("kv_connector")
    if not isinstance(name, str) or not name:
        problems.append(
            f"{where} has no 'kv_connector' class name; add e.g. "
            '"kv_connector": "LMCacheMPConnector"'
        )
        return None
    where = f"{where} ({name})"
    fields = {
        "kv_role": parent.kv_role,
        "kv_buffer_device": parent.kv_buffer_device,
        **raw,
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
            f"check that module {path!r} is installed and defines {name}"
            if path
            else "use a connector name vLLM registers (e.g. ExampleConnector, "
            "LMCacheMPConnector, NixlConnector) or set kv_connector_module_path"
        )
        problems.append(f"{where} cannot be loaded ({type(e).__name__}: {e}); {fix}")
        return None
    if not (isinstance(cls, type) and issubclass(cls, KVConnectorBase_V1)):
        problems.append(f"{where} resolves to {cls!r}, which is not a KVConnectorBase_V1 subclass")
        return None
    return name, ktc, cls


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

    raw_children = extra.get("connectors")
    children: list[tuple[str, KVTransferConfig, type]] = []
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
            got = _child(i, raw, kv_transfer_config, problems)
            if got is not None:
                children.append((i, *got))  # type: ignore[arg-type]
    if problems:
        raise KvmuxConfigError(problems)

    counts: dict[str, int] = {}
    for _, name, _, _ in children:  # type: ignore[misc]
        counts[name] = counts.get(name, 0) + 1
    specs = tuple(
        ChildSpec(
            index=i,
            name=name if counts[name] == 1 else f"{name}#{i}",
            transfer_config=ktc,
            cls=cls,
            supports_hma=KVConnectorFactory.supports_hma_config(ktc),
        )
        for i, name, ktc, cls in children  # type: ignore[misc]
    )
    return MuxConfig(children=specs, clash_policy=clash, load_policy=load)


def check_hma(cfg: MuxConfig, hma_enabled: bool) -> None:
    """Refuse the hybrid KV cache manager when a child cannot follow it."""
    missing = cfg.non_hma_children()
    if hma_enabled and missing:
        raise KvmuxConfigError(
            f"the hybrid KV cache manager (HMA) is on but child connector(s) "
            f"{missing} do not support it; {HMA_FIX}"
        )
