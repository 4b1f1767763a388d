"""kvmux against what users would pick instead, side by side in one run:
P1 the scheduler-side request lifecycle (P1h: with the host tier as the one
child, doing real work) and P2 the worker's per-layer hooks against vLLM's
MultiConnector over the same children, P3 the host tier's prefix lookup
against vLLM's SimpleCPUOffloadConnector, P4 the host tier's copies against a
plain contiguous torch copy, S1 requests' time to schedule (p50, p99) while
one child stalls, kvmux's lookup deadline against MultiConnector, C1 (C1L:
with the real LMCache server as the second tier) the time to load prefixes
split between two tiers, ``load_policy`` compose against first and longest.
Prints median, spread and ratio per comparison. A case that cannot run on
this machine (C1L without LMCache) is named with the reason: an error under
``--only``, a line on stderr otherwise.

Run from the repository root of a source checkout (the cases build on
``tests/support``): ``python -m benches.overhead [--quick] [--only P1 ...]``.
The benchmarks an operator runs against a vLLM of theirs are the wheel's:
``python -m kvmux bench serve`` and ``bench fleet``."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

__all__ = ["add_arguments", "main", "run"]

PROG = "python -m benches.overhead"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from benches.overhead import CASES, UNAVAILABLE

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


def run(args: argparse.Namespace, argv: Sequence[str] = ()) -> int:
    """Run the comparisons ``args`` selects; ``argv``: the command line's
    arguments, recorded in the JSON."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    logging.getLogger("vllm").setLevel(logging.ERROR)
    from benches.overhead import CASES, UNAVAILABLE
    from benches.overhead.runner import BLOCK_SIZE_CASES, format_table, write_json, write_plot
    from benches.overhead.runner import run as run_cases
    from benches.overhead.timing import Progress
    from kvmux.bench.lmcache import refused

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
        write_json(args.json, results, argv)
        print(f"JSON: {args.json}")
    if args.plot:
        write_plot(args.plot, results)
        print(f"plot: {args.plot}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv), argv)
