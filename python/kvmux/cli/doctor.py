"""Check a --kv-transfer-config before starting vLLM: parse it, resolve and
import every child connector, report HMA capability, what the hybrid KV cache
manager means for plain and hybrid models (for one local model with
``--model PATH``), what ``KvmuxHostCache`` stores of each kind of layer (when
the config has it) and KV cache layout requirements, and list every problem
with its fix. ``--disable-hybrid-kv-cache-manager`` checks an instance run
with that vLLM flag; ``--json`` prints the report as JSON. Exit status 0:
valid; 1: problems found; 2: the input (config or model folder) is not
readable.

``--peer CONFIG`` checks a prefill/decode pair: ``CONFIG`` is the
prefill's, ``--peer`` the decode's, and what NIXL needs the two to agree on
(``kvmux.cli.pd_pair``) is compared before either instance starts.

``--fleet INSTANCE`` (repeatable) checks instances that share KV through
LMCache's distributed store: ``CONFIG`` and each ``--fleet`` are then
instance files (``{"vllm_serve": ..., "lmcache_server": ...}``) and what
LMCache's keys need them to agree on is compared (``kvmux.cli.fleet``).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvmux.cli.model_kv import ModelKV, read_model_kv

__all__ = ["Report", "add_arguments", "diagnose", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config",
        help="a --kv-transfer-config JSON string, or a path to a file holding one "
        "(with --fleet: an instance file)",
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a local model folder (its config.json): say whether this config starts for it",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument(
        "--peer",
        metavar="CONFIG",
        help="the decode instance's --kv-transfer-config (CONFIG is then the prefill's): "
        "check what NIXL needs both to agree on",
    )
    p.add_argument(
        "--fleet",
        metavar="INSTANCE",
        action="append",
        default=[],
        help="another instance sharing KV through LMCache's L2 store (repeatable); CONFIG "
        'and each INSTANCE are then instance files, JSON {"vllm_serve": "<vllm serve '
        'command line>", "lmcache_server": "<LMCache MP server command line>", "host": '
        '"<machine>" (optional)}: check what LMCache needs them to agree on',
    )
    p.add_argument(
        "--disable-hybrid-kv-cache-manager",
        dest="disable_hma",
        action="store_true",
        help="CONFIG's instance runs with this vLLM flag",
    )
    p.add_argument(
        "--peer-disable-hybrid-kv-cache-manager",
        dest="peer_disable_hma",
        action="store_true",
        help="the --peer instance runs with --disable-hybrid-kv-cache-manager",
    )


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


def _load(text: str) -> Any:
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

    from kvmux.config import HMA_FIX, known_crash, parse_mux_config
    from kvmux.connector import KvmuxConnector
    from kvmux.errors import KvmuxConfigError
    from kvmux.parent_name import parent_name_problems

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


def hit_source(cls: type) -> str:
    """How vLLM's ``prompt_tokens_cached_by_source`` labels a connector's
    hits: ``source="<its _cache_hit_source>"``, or its own split when it
    splits them itself (then that is its fallback)."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    from kvmux import _versions
    from kvmux.scheduler import own_source

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


def run(args: argparse.Namespace) -> int:
    if getattr(args, "fleet", None):
        if args.peer is not None or args.model or args.disable_hma or args.peer_disable_hma:
            print(
                "kvmux doctor: --fleet reads everything from the instance files' command "
                "lines; drop --peer, --model and the --disable-hybrid-kv-cache-manager flags"
            )
            return 2
        from kvmux.cli.fleet import run_fleet

        return run_fleet(args)
    try:
        raw = _load(args.config)
    except (OSError, ValueError) as e:
        print(f"kvmux doctor: cannot read the config ({e}); give a JSON object or a file path")
        return 2
    model = None
    if args.model:
        try:
            model = read_model_kv(args.model)
        except (OSError, ValueError) as e:
            print(f"kvmux doctor: cannot read the model ({e})")
            return 2
    rep = diagnose(raw, model, disable_hma=args.disable_hma)
    if args.peer is not None:
        try:
            peer_raw = _load(args.peer)
        except (OSError, ValueError) as e:
            print(
                f"kvmux doctor: cannot read the --peer config ({e}); give a JSON object or a file"
            )
            return 2
        diagnose_pair(rep, raw, peer_raw, model, args.disable_hma, args.peer_disable_hma)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
        return 0 if rep.ok else 1
    _print(rep, "prefill: " if rep.peer is not None else "")
    if rep.peer is not None:
        _print(rep.peer, "decode (--peer): ")
        print("prefill/decode pair:")
        for line in rep.pair:
            print(f"  {line}")
        for p in rep.pair_problems:
            print(f"problem: {p}")
    problems = len(rep.problems) + len(rep.pair_problems)
    problems += len(rep.peer.problems) if rep.peer is not None else 0
    print("OK" if rep.ok else f"{problems} problem(s) found")
    return 0 if rep.ok else 1


def diagnose_pair(
    rep: Report,
    raw: Any,
    peer_raw: Any,
    model: ModelKV | None = None,
    disable_hma: bool = False,
    peer_disable_hma: bool = False,
) -> Report:
    """Add to ``rep`` (the prefill's report) the decode's report and what the
    pair must agree on (``kvmux.cli.pd_pair``); returns ``rep``."""
    from kvmux.cli.pd_pair import check_pair, describe_side

    rep.peer = diagnose(peer_raw, model, disable_hma=peer_disable_hma)
    if rep.problems or rep.peer.problems or not rep.children or not rep.peer.children:
        rep.pair.append("not compared: fix each side's own problems first")
        return rep
    prefill = describe_side("prefill", raw, disable_hma)
    decode = describe_side("decode", peer_raw, peer_disable_hma)
    notes, problems, warnings = check_pair(prefill, decode)
    rep.pair.extend(notes)
    rep.pair_problems.extend(problems)
    rep.warnings.extend(warnings)
    return rep


def _print(rep: Report, head: str) -> None:
    print(f"{head}connector: {rep.connector}")
    for c in rep.children:
        hma = "HMA" if c["supports_hma"] else "no HMA"
        deadline = c.get("lookup_timeout_ms")
        late = f", a miss after {deadline:g} ms not ready" if deadline is not None else ""
        load_deadline = c.get("load_timeout_ms")
        if load_deadline is not None:
            late += f", a load failed after {load_deadline:g} ms unfinished"
        from kvmux.config import DEFAULT_BREAKER

        b = c.get("breaker")
        breaker = (
            ", no breaker"
            if b is None
            else ""
            if b == asdict(DEFAULT_BREAKER)
            else f", breaker: open after {b['failures']} failed lookups for "
            f"{b['cooldown_ms']:g}-{b['max_cooldown_ms']:g} ms"
        )
        src = c.get("hit_source")
        hits = f"; its hits count as {src}" if src else ""
        print(f"  child {c['name']}: {c['class']} ({hma}{late}{breaker}){hits}")
    if rep.hma:
        print(f"hybrid KV cache manager: {rep.hma}")
    if rep.model:
        print(f"model: {rep.model}")
    if rep.host_tier:
        print(f"host tier: {rep.host_tier}")
    if rep.kv_cache_layout:
        print(f"KV cache layout required: {rep.kv_cache_layout}")
    for w in rep.warnings:
        print(f"warning: {w}")
    for p in rep.problems:
        print(f"problem: {p}")
