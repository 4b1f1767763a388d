"""The command line (``python -m kvmux``): ``doctor`` (one config, a P/D pair,
a fleet), the demos, ``--help``."""
