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
from dataclasses import asdict
from typing import Any

from kvmux.cli.diagnosis import Report, diagnose, load_json
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
        raw = load_json(args.config)
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
            peer_raw = load_json(args.peer)
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
        from kvmux.mux.config import DEFAULT_BREAKER

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
        if c.get("storage"):
            print(f"    files: {c['storage']}")
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
