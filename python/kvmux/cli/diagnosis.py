"""What ``doctor`` finds about one --kv-transfer-config (:func:`diagnose`,
its :class:`Report`), read as JSON from a string or a file
(:func:`load_json`). The checks of a prefill/decode pair
(``kvmux.cli.pd_pair``) and of a fleet (``kvmux.cli.fleet``) build on it;
``kvmux.cli.doctor`` is the command line over all three."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmux.cli.model_kv import ModelKV

__all__ = ["Report", "diagnose", "hit_source", "load_json"]


@dataclass
class Report:
    connector: str | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    hma: str | None = None
    model: str | None = None
    kv_cache_layout: str | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    peer: Report | None = None
    """With ``--peer``: the decode's own report."""
    pair: list[str] = field(default_factory=list)
    """With ``--peer``: what the two instances agree on."""
    pair_problems: list[str] = field(default_factory=list)
    """With ``--peer``: what they disagree on, each with its fix."""
    host_tier: str | None = None
    """With ``KvmuxHostCache`` in the config: its HMA support and what it
    stores of each kind of layer (of ``--model``'s, when given)."""

    @property
    def ok(self) -> bool:
        return not self.problems and not self.pair_problems and (self.peer is None or self.peer.ok)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if k != "peer"}
        if self.peer is not None:
            out["peer"] = self.peer.as_dict()
        return {**out, "ok": self.ok}


def load_json(text: str) -> Any:
    """A JSON value from ``text``, or from the file it names (a text that
    does not start with ``{`` and is a path to a file)."""
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        text = path.read_text()
    return json.loads(text)


def _cls_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def diagnose(raw: Any, model: ModelKV | None = None, disable_hma: bool = False) -> Report:
    """Everything ``doctor`` finds about one --kv-transfer-config dict (and,
    given ``model``, about serving that model with it; ``disable_hma``: the
    instance runs with ``--disable-hybrid-kv-cache-manager``)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvmux._core import HMA_FIX
    from kvmux.errors import KvmuxConfigError
    from kvmux.mux.config import known_crash, parse_mux_config
    from kvmux.mux.connector import KvmuxConnector
    from kvmux.mux.parent_name import parent_name_problems

    rep = Report()
    if not isinstance(raw, dict):
        rep.problems.append(
            f"the config is a JSON {type(raw).__name__}; it must be an object "
            '{"kv_connector": ..., "kv_role": ...}'
        )
        return rep
    rep.connector = raw.get("kv_connector")
    try:
        ktc = KVTransferConfig(**raw)
    except Exception as e:
        rep.problems.append(f"not a valid kv_transfer_config: {e}")
        return rep
    try:
        cls = KVConnectorFactory.get_connector_class(ktc)
    except Exception as e:
        rep.problems.append(f"connector {rep.connector!r} cannot be loaded: {e}")
        return rep
    if not (isinstance(cls, type) and issubclass(cls, KvmuxConnector)):
        crash = known_crash(cls, ktc, f"connector {rep.connector!r}")
        if crash is not None:
            rep.problems.append(crash)
        validate = getattr(cls, "validate_transfer_config", None)
        try:
            if callable(validate):
                validate(ktc)
        except KvmuxConfigError as e:
            rep.problems.extend(e.problems)
        hma = KVConnectorFactory.supports_hma_config(ktc)
        rep.children.append(
            {
                "name": rep.connector,
                "class": _cls_path(cls),
                "supports_hma": hma,
                "hit_source": hit_source(cls),
            }
        )
        _host_tier(rep, [cls], hma and not disable_hma, model)
        rep.hma = (
            "vLLM keeps the hybrid KV cache manager on"
            if hma
            else "vLLM turns the hybrid KV cache manager off for this connector by itself"
        )
        if disable_hma:
            _hma_disabled(rep, model)
            return rep
        if model is not None:
            rep.model = model.describe()
            if not hma and model.needs_hma:
                rep.problems.append(_needs_hma(model, [str(rep.connector)]))
        return rep
    try:
        cfg = parse_mux_config(ktc)
    except KvmuxConfigError as e:
        rep.problems.extend(e.problems)
        return rep
    # What vLLM decides from the connector's name (with vLLM's defaults).
    rep.problems.extend(parent_name_problems(ktc, cfg))
    for spec in cfg.children:
        rep.children.append(
            {
                "name": spec.name,
                "class": _cls_path(spec.cls),
                "kv_role": spec.transfer_config.kv_role,
                "supports_hma": spec.supports_hma,
                "lookup_timeout_ms": spec.lookup_timeout_ms,
                "load_timeout_ms": spec.load_timeout_ms,
                "breaker": None if spec.breaker is None else asdict(spec.breaker),
                "hit_source": hit_source(spec.cls),
                **_example_storage(rep, spec.name, spec.cls, spec.transfer_config),
            }
        )
    if disable_hma:
        _hma_disabled(rep, model)
    else:
        _hma(rep, ktc.kv_connector, cfg.non_hma_children(), model, HMA_FIX)
    _host_tier(
        rep,
        [spec.cls for spec in cfg.children],
        not disable_hma and KVConnectorFactory.supports_hma_config(ktc),
        model,
    )
    try:
        vcfg = VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"))
        rep.kv_cache_layout = KvmuxConnector.get_required_kvcache_layout(vcfg) or "any"
    except KvmuxConfigError as e:
        rep.problems.extend(e.problems)
    except Exception as e:  # a child needs more than a bare config to answer
        rep.warnings.append(f"KV cache layout requirement unknown: {type(e).__name__}: {e}")
    return rep


def _example_storage(rep: Report, name: str, cls: type, ktc: Any) -> dict[str, str]:
    """Where vLLM's ``ExampleConnector`` child keeps its files under kvmux (one
    folder per model: ``kvmux.mux.example_storage``); a warning when its
    ``shared_storage_path`` is not set (vLLM's default, ``/tmp``)."""
    from kvmux.mux.example_storage import DEFAULT_PATH, is_example_connector

    if not is_example_connector(cls):
        return {}
    path = ktc.get_from_extra_config("shared_storage_path", None)
    if not path:
        rep.warnings.append(
            f"{name}: shared_storage_path is not set, so its files go under {DEFAULT_PATH} "
            "(vLLM's default), beside whatever else is there; set "
            'kv_connector_extra_config {"shared_storage_path": "<a folder of its own>"}'
        )
    return {
        "storage": f"{path or DEFAULT_PATH}/kvmux-<model>-<digest>: one folder per model "
        "(its files are named by the prompt's tokens alone; kvmux keeps models apart)"
    }


def hit_source(cls: type) -> str:
    """How vLLM's ``prompt_tokens_cached_by_source`` labels a connector's
    hits: ``source="<its _cache_hit_source>"``, or its own split when it
    splits them itself (then that is its fallback)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvmux import _versions
    from kvmux.mux.scheduler import own_source

    if not _versions.HAS_HIT_SOURCES:
        return "no source (this vLLM does not split external hits by source; vLLM 0.32 and 0.33 do)"
    src = f'source="{own_source(cls)}"'
    own = getattr(cls, "get_external_cache_hit_sources", None)
    if own is not None and own is not KVConnectorBase_V1.get_external_cache_hit_sources:
        return f"its own split by source (else {src})"
    return src


def _host_tier(rep: Report, classes: list[type], hma_on: bool, model: ModelKV | None) -> None:
    """What ``KvmuxHostCache`` (if the config has it) stores for the model."""
    from kvmux.cli.model_kv import CHUNKED, FULL, SLIDING, STATE
    from kvmux.host_cache.connector import KvmuxHostCache

    if not any(isinstance(c, type) and issubclass(c, KvmuxHostCache) for c in classes):
        return
    stores = {
        FULL: "every full block",
        SLIDING: "only the window before each resume point",
        CHUNKED: "only the chunk before each resume point",
    }
    if not hma_on:
        rep.host_tier = (
            "KvmuxHostCache supports HMA, but it is off here: vLLM gives every attention "
            "layer one KV cache group, and the tier stores every full block of every layer"
        )
    elif model is None:
        each = "; ".join(f"{k} layers: {v}" for k, v in stores.items())
        rep.host_tier = f"KvmuxHostCache supports HMA: it stores every KV cache group, {each}"
    else:
        kinds = [f"{n} {k} layers: {stores[k]}" for k, n in model.layers.items() if k in stores]
        rep.host_tier = "KvmuxHostCache supports HMA; for this model it stores " + (
            "; ".join(kinds) or "nothing"
        )
    if model is not None and STATE in model.layers:
        rep.problems.append(
            f"model {model.path} ({model.describe()}) has state-space layers; KvmuxHostCache "
            "stores attention KV only and refuses their KV cache group at start-up: remove "
            "KvmuxHostCache from the connectors for this model"
        )


def _needs_hma(model: ModelKV, missing: list[str]) -> str:
    return (
        f"model {model.path} ({model.describe()}) has state-space layers, which vLLM runs "
        f"only with the hybrid KV cache manager on, and {missing} lack HMA support (with "
        "them, kvmux refuses a model of several KV cache groups and vLLM turns HMA off); "
        "use only children that support HMA for this model"
    )


def _hma_disabled(rep: Report, model: ModelKV | None) -> None:
    rep.hma = "off: --disable-hybrid-kv-cache-manager is given"
    if model is None:
        return
    rep.model = model.describe()
    if model.needs_hma:
        rep.problems.append(
            f"model {model.path} ({model.describe()}) has state-space layers, which vLLM runs "
            "only with the hybrid KV cache manager on; drop --disable-hybrid-kv-cache-manager"
        )


def _hma(
    rep: Report, name: str | None, missing: list[str], model: ModelKV | None, fix: str
) -> None:
    """What the hybrid KV cache manager means for this config (and model)."""
    if model is not None:
        rep.model = model.describe()
    if not missing:
        rep.hma = (
            "every child supports it: vLLM keeps the hybrid KV cache manager on; "
            "plain and hybrid models run"
        )
        return
    if name == "MultiConnector":
        rep.hma = (
            f"vLLM will turn the hybrid KV cache manager off ({missing} lack it); plain "
            "models and hybrid models with attention layers run"
        )
        if model is not None and model.needs_hma:
            rep.problems.append(_needs_hma(model, missing))
        return
    rep.hma = (
        f"vLLM keeps the hybrid KV cache manager on for {name!r}; {missing} lack HMA "
        "support: plain models (one KV cache group) run as configured, hybrid models "
        f"(several groups) are refused at start-up, and for them {fix}"
    )
    if model is None or not model.hybrid:
        return
    if model.needs_hma:
        rep.problems.append(_needs_hma(model, missing))
    else:
        rep.problems.append(
            f"model {model.path} is hybrid ({model.describe()}): kvmux will refuse to "
            f"start because {missing} lack HMA support; {fix}"
        )
