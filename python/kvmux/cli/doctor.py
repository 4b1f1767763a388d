"""Check a --kv-transfer-config before starting vLLM: parse it, resolve and
import every child connector, report HMA capability and KV cache layout
requirements, and list every problem with its fix. Exit status 0: valid;
1: problems found; 2: the input is not readable JSON."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Report", "add_arguments", "diagnose", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "config", help="a --kv-transfer-config JSON string, or a path to a file holding one"
    )
    p.add_argument("--json", action="store_true", help="print the report as JSON")


@dataclass
class Report:
    connector: str | None = None
    children: list[dict[str, Any]] = field(default_factory=list)
    hma: str | None = None
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


def diagnose(raw: Any) -> Report:
    """Everything ``doctor`` finds about one --kv-transfer-config dict."""
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
        rep.children.append(
            {
                "name": rep.connector,
                "class": _cls_path(cls),
                "supports_hma": KVConnectorFactory.supports_hma_config(ktc),
            }
        )
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
    missing = cfg.non_hma_children()
    if not missing:
        rep.hma = "every child supports the hybrid KV cache manager"
    elif ktc.kv_connector == "MultiConnector":
        rep.hma = f"vLLM will turn the hybrid KV cache manager off ({missing} lack it)"
    else:
        rep.hma = f"{missing} lack hybrid KV cache manager support"
        rep.warnings.append(
            f"on GPU platforms vLLM keeps the hybrid KV cache manager on for "
            f"{ktc.kv_connector!r} and kvmux will then refuse to start; {HMA_FIX}"
        )
    try:
        vcfg = VllmConfig(kv_transfer_config=ktc, device_config=DeviceConfig(device="cpu"))
        rep.kv_cache_layout = KvmuxConnector.get_required_kvcache_layout(vcfg) or "any"
    except KvmuxConfigError as e:
        rep.problems.extend(e.problems)
    except Exception as e:  # a child needs more than a bare config to answer
        rep.warnings.append(f"KV cache layout requirement unknown: {type(e).__name__}: {e}")
    return rep


def run(args: argparse.Namespace) -> int:
    try:
        raw = _load(args.config)
    except (OSError, ValueError) as e:
        print(f"kvmux doctor: cannot read the config ({e}); give a JSON object or a file path")
        return 2
    rep = diagnose(raw)
    if args.json:
        print(json.dumps({**rep.__dict__, "ok": rep.ok}, indent=2))
        return 0 if rep.ok else 1
    print(f"connector: {rep.connector}")
    for c in rep.children:
        hma = "HMA" if c["supports_hma"] else "no HMA"
        print(f"  child {c['name']}: {c['class']} ({hma})")
    if rep.hma:
        print(f"hybrid KV cache manager: {rep.hma}")
    if rep.kv_cache_layout:
        print(f"KV cache layout required: {rep.kv_cache_layout}")
    for w in rep.warnings:
        print(f"warning: {w}")
    for p in rep.problems:
        print(f"problem: {p}")
    print("OK" if rep.ok else f"{len(rep.problems)} problem(s) found")
    return 0 if rep.ok else 1
