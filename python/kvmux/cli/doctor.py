"""Check a --kv-transfer-config before starting vLLM: parse it, resolve and
import every child connector, report HMA capability, what the hybrid KV cache
manager means for plain and hybrid models (for one local model with
``--model PATH``) and KV cache layout requirements, and list every problem
with its fix. Exit status 0: valid; 1: problems found; 2: the input (config
or model folder) is not readable."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvmux.cli.model_kv import ModelKV, read_model_kv

__all__ = ["Report", "add_arguments", "diagnose", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", help="a --kv-transfer-config JSON string, or a path to a file holding one"
    )
    p.add_argument(
        "--model",
        metavar="PATH",
        help="a local model folder (its config.json): say whether this config starts for it",
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@dataclass
class Report:
    connector: str | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    hma: str | None = None
    model: str | None = None
    kv_cache_layout: str | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def _load(text: str) -> Any:
    path = Path(text)
    if not text.lstrip().startswith("{") and path.is_file():
        text = path.read_text()
    return json.loads(text)


def _cls_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def diagnose(raw: Any, model: ModelKV | None = None) -> Report:
    """Everything ``doctor`` finds about one --kv-transfer-config dict (and,
    given ``model``, about serving that model with it)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm.config import DeviceConfig, KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvmux.config import HMA_FIX, parse_mux_config
    from kvmux.connector import KvmuxConnector
    from kvmux.errors import KvmuxConfigError

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
        validate = getattr(cls, "validate_transfer_config", None)
        try:
            if callable(validate):
                validate(ktc)
        except KvmuxConfigError as e:
            rep.problems.extend(e.problems)
        hma = KVConnectorFactory.supports_hma_config(ktc)
        rep.children.append({"name": rep.connector, "class": _cls_path(cls), "supports_hma": hma})
        rep.hma = (
            "vLLM keeps the hybrid KV cache manager on"
            if hma
            else "vLLM turns the hybrid KV cache manager off for this connector by itself"
        )
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
    for spec in cfg.children:
        rep.children.append(
            {
                "name": spec.name,
                "class": _cls_path(spec.cls),
                "kv_role": spec.transfer_config.kv_role,
                "supports_hma": spec.supports_hma,
            }
        )
    _hma(rep, ktc.kv_connector, cfg.non_hma_children(), model, HMA_FIX)
    try:
        vcfg = VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"))
        rep.kv_cache_layout = KvmuxConnector.get_required_kvcache_layout(vcfg) or "any"
    except KvmuxConfigError as e:
        rep.problems.extend(e.problems)
    except Exception as e:  # a child needs more than a bare config to answer
        rep.warnings.append(f"KV cache layout requirement unknown: {type(e).__name__}: {e}")
    return rep


def _needs_hma(model: ModelKV, missing: list[str]) -> str:
    return (
        f"model {model.path} ({model.describe()}) has state-space layers, which vLLM runs "
        f"only with the hybrid KV cache manager on, and {missing} lack HMA support (with "
        "them, kvmux refuses a model of several KV cache groups and vLLM turns HMA off); "
        "use only children that support HMA for this model"
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
    rep = diagnose(raw, model)
    if args.json:
        print(json.dumps({**rep.__dict__, "ok": rep.ok}, indent=2))
        return 0 if rep.ok else 1
    print(f"connector: {rep.connector}")
    for c in rep.children:
        hma = "HMA" if c["supports_hma"] else "no HMA"
        print(f"  child {c['name']}: {c['class']} ({hma})")
    if rep.hma:
        print(f"hybrid KV cache manager: {rep.hma}")
    if rep.model:
        print(f"model: {rep.model}")
    if rep.kv_cache_layout:
        print(f"KV cache layout required: {rep.kv_cache_layout}")
    for w in rep.warnings:
        print(f"warning: {w}")
    for p in rep.problems:
        print(f"problem: {p}")
    print("OK" if rep.ok else f"{len(rep.problems)} problem(s) found")
    return 0 if rep.ok else 1
