"""The cross-side check of a prefill/decode pair (``doctor PREFILL --peer
DECODE``): what NIXL needs both instances to agree on, read from their two
``--kv-transfer-config`` before either starts.

NIXL (vLLM's ``NixlConnector``) refuses every transfer between two instances
whose compatibility hashes differ: the decode fails the first request with
"NIXL compatibility hash mismatch". The hash covers the vLLM version, the
model (as named on the command line), its dtype, KV heads, head size and
layer count, the attention backend, the KV cache dtype, the speculative
config, whether the hybrid KV cache manager is on, and the transfer mode.
Two of those follow from the configs: the transfer mode (``NixlConnector``
or ``NixlPullConnector`` pull, ``NixlPushConnector`` pushes) and the hybrid
manager, which vLLM decides from the connector class before anything is
built: on for a class that supports it (``NixlConnector``,
``KvmuxConnector``), off for one that does not, and for a connector named
``MultiConnector`` off as soon as one child lacks it. That last case is the
classic mismatch: a ``MultiConnector`` prefill over NIXL and an offload
tier without HMA support against a plain NIXL decode. kvmux's own name,
``KvmuxConnector``, keeps the manager on like a plain ``NixlConnector``.

Also checked: each side has exactly one NIXL connector, the prefill's NIXL
role can send and the decode's can receive, and the two share a NIXL
backend.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["NixlChild", "Side", "check_pair", "describe_side"]

PULL, PUSH = "pull", "push"
SENDS = ("kv_producer", "kv_both")
RECEIVES = ("kv_consumer", "kv_both")
HASH_NOTE = (
    "NIXL's compatibility hash includes it, so every transfer would fail with "
    "'NIXL compatibility hash mismatch' at the first request"
)


@dataclass(frozen=True)
class NixlChild:
    """A NIXL connector of one side (the side's connector itself, or a child)."""

    name: str
    kv_role: str
    mode: str
    backends: tuple[str, ...]
    enforce_compat: bool


@dataclass
class Side:
    """One instance of the pair, as its config makes it."""

    label: str
    connector: str | None
    nixl: list[NixlChild] = field(default_factory=list)
    hma_on: bool | None = None
    """Whether vLLM runs the hybrid KV cache manager (None: not known)."""
    hma_why: str = ""
    hma_fix: str = ""
    """How this side turns the manager on, when it is off."""


def _nixl_classes() -> tuple[type | None, type | None]:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.nixl.connector import (
            NixlBaseConnector,
            NixlPushConnector,
        )
    except ImportError:  # a vLLM without NIXL's connector module
        return None, None
    return NixlBaseConnector, NixlPushConnector


def _nixl_child(name: str, cls: type, ktc: Any) -> NixlChild | None:
    base, push = _nixl_classes()
    if base is None or not (isinstance(cls, type) and issubclass(cls, base)):
        return None
    extra: Mapping[str, Any] = ktc.kv_connector_extra_config or {}
    backends = extra.get("backends", ["UCX"])
    return NixlChild(
        name=name,
        kv_role=str(ktc.kv_role),
        mode=PUSH if push is not None and issubclass(cls, push) else PULL,
        backends=tuple(str(b) for b in backends) if isinstance(backends, list) else ("UCX",),
        enforce_compat=bool(extra.get("enforce_handshake_compat", True)),
    )


def describe_side(label: str, raw: Mapping[str, Any], disable_hma: bool = False) -> Side:
    """What one side's config makes of NIXL and of the hybrid manager (the
    config must already have passed ``doctor``'s own checks)."""
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvmux.mux.config import parse_mux_config
    from kvmux.mux.connector import KvmuxConnector

    ktc = KVTransferConfig(**raw)
    cls = KVConnectorFactory.get_connector_class(ktc)
    side = Side(label, ktc.kv_connector)
    lacking: list[str] = []
    if isinstance(cls, type) and issubclass(cls, KvmuxConnector):
        cfg = parse_mux_config(ktc)
        for spec in cfg.children:
            child = _nixl_child(spec.name, spec.cls, spec.transfer_config)
            if child is not None:
                side.nixl.append(child)
        lacking = cfg.non_hma_children()
    else:
        child = _nixl_child(str(ktc.kv_connector), cls, ktc)
        if child is not None:
            side.nixl.append(child)
        children = (ktc.kv_connector_extra_config or {}).get("connectors")
        if ktc.kv_connector == "MultiConnector" and isinstance(children, list):
            for c in children:
                child_ktc = KVTransferConfig(**{"engine_id": ktc.engine_id, **c})
                child_cls = KVConnectorFactory.get_connector_class(child_ktc)
                nixl = _nixl_child(str(child_ktc.kv_connector), child_cls, child_ktc)
                if nixl is not None:
                    side.nixl.append(nixl)
                if not KVConnectorFactory.supports_hma_config(child_ktc):
                    lacking.append(str(child_ktc.kv_connector))
    _decide_hma(side, ktc, cls, lacking, disable_hma)
    return side


def _decide_hma(side: Side, ktc: Any, cls: type, lacking: list[str], disable: bool) -> None:
    """vLLM's decision (``VllmConfig``), made before the connector is built."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    from kvmux.mux.connector import KvmuxConnector

    if disable:
        side.hma_on = False
        side.hma_why = "--disable-hybrid-kv-cache-manager is given"
        side.hma_fix = f"drop --disable-hybrid-kv-cache-manager on the {side.label}"
        return
    if KVConnectorFactory.supports_hma_config(ktc):
        side.hma_on = True
        side.hma_why = f"{side.connector} supports it, so vLLM keeps it on"
        return
    side.hma_on = False
    if ktc.kv_connector == "MultiConnector":
        side.hma_why = (
            f"vLLM turns it off: under the name MultiConnector it asks every child, and "
            f"{lacking} lack HMA support"
        )
        if issubclass(cls, KvmuxConnector):
            side.hma_fix = (
                f'name the {side.label}\'s connector "KvmuxConnector" (same class, '
                'kv_connector_module_path "kvmux"): vLLM then keeps the manager on and '
                "kvmux runs every child on a plain model"
            )
        else:
            side.hma_fix = (
                f'run the {side.label} with "KvmuxConnector" (kv_connector_module_path '
                '"kvmux", the same "connectors" list): vLLM then keeps the manager on '
                "and kvmux runs every child on a plain model"
            )
    else:
        side.hma_why = f"vLLM turns it off: {side.connector} does not support HMA"


def _on(value: bool | None) -> str:
    return "on" if value else "off"


def check_pair(prefill: Side, decode: Side) -> tuple[list[str], list[str], list[str]]:
    """``(notes, problems, warnings)`` about the pair, each problem with its fix."""
    notes: list[str] = []
    problems: list[str] = []
    warnings: list[str] = []
    for side in (prefill, decode):
        if not side.nixl:
            problems.append(
                f"the {side.label} ({side.connector}) has no NIXL connector; both instances of "
                'a prefill/decode pair need one: add {"kv_connector": "NixlConnector", ...} '
                "(or NixlPushConnector) to its connectors"
            )
        elif len(side.nixl) > 1:
            problems.append(
                f"the {side.label} lists {len(side.nixl)} NIXL connectors "
                f"{[c.name for c in side.nixl]}; a prefill/decode pair runs one per instance"
            )
    if problems:
        return notes, problems, warnings
    p, d = prefill.nixl[0], decode.nixl[0]
    if p.mode != d.mode:
        problems.append(
            f"the prefill's {p.name} transfers by {p.mode} and the decode's {d.name} by "
            f"{d.mode}: the transfer mode is part of NIXL's compatibility hash, and every "
            "transfer would fail; use NixlConnector on both (pull) or NixlPushConnector "
            "on both (push)"
        )
    else:
        notes.append(f"NIXL: {p.mode} on both ({p.name} -> {d.name})")
    if prefill.hma_on is not None and decode.hma_on is not None:
        if prefill.hma_on == decode.hma_on:
            notes.append(
                f"hybrid KV cache manager: {_on(prefill.hma_on)} on both "
                "(NIXL's compatibility hash includes it)"
            )
        else:
            off, on = (prefill, decode) if not prefill.hma_on else (decode, prefill)
            fixes = [f for f in (off.hma_fix,) if f] + [
                f"pass --disable-hybrid-kv-cache-manager to the {on.label} too"
            ]
            problems.append(
                f"the hybrid KV cache manager would be {_on(prefill.hma_on)} on the prefill "
                f"({prefill.hma_why}) and {_on(decode.hma_on)} on the decode "
                f"({decode.hma_why}); {HASH_NOTE}. Fix: " + ", or ".join(fixes)
            )
    if p.kv_role not in SENDS:
        problems.append(
            f"the prefill's {p.name} has kv_role {p.kv_role!r}, which does not send KV; "
            'give it "kv_role": "kv_producer"'
        )
    if d.kv_role not in RECEIVES:
        problems.append(
            f"the decode's {d.name} has kv_role {d.kv_role!r}, which does not receive KV; "
            'give it "kv_role": "kv_consumer"'
        )
    if not set(p.backends) & set(d.backends):
        problems.append(
            f"the prefill's NIXL backends {list(p.backends)} and the decode's "
            f'{list(d.backends)} share none; list a common one (default ["UCX"])'
        )
    for side, c in ((prefill, p), (decode, d)):
        if not c.enforce_compat:
            warnings.append(
                f"the {side.label}'s {c.name} sets enforce_handshake_compat false: a "
                "mismatch of the settings above then shows as wrong KV, not as an error"
            )
    return notes, problems, warnings
