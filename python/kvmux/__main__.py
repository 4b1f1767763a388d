"""``python -m kvmux``: see ``python -m kvmux --help``."""

from kvmux.cli import main

raise SystemExit(main())
