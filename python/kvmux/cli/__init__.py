"""kvmux's command line: ``python -m kvmux {demo,doctor,bench}``."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Sequence

__all__ = ["main"]

# subcommand -> (module, help); each module has add_arguments(parser) and run(args) -> int
COMMANDS = {
    "demo": ("kvmux.cli.demo", "a real vLLM engine on the CPU serving from kvmux's host tier"),
    "doctor": ("kvmux.cli.doctor", "check a --kv-transfer-config before starting vLLM"),
    "bench": (
        "kvmux.cli.bench",
        "serve, fleet: time to first token on real vLLM servers, kvmux against the others",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvmux", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module, help_text) in COMMANDS.items():
        mod = importlib.import_module(module)
        modules[name] = mod
        mod.add_arguments(sub.add_parser(name, help=help_text, description=mod.__doc__))
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)
