"""``python -m kvmux``: see ``python -m kvmux --help``."""

from kvmux.cli import main

# The guard matters: vLLM starts its engine and workers with spawn, which
# imports this module again in each child process.
if __name__ == "__main__":
    raise SystemExit(main())
