"""The multiplexer: :class:`~kvmux.mux.connector.KvmuxConnector` and what it
is made of, each side in its own file (``scheduler.py``, ``worker.py``), its
children (``children.py``), config (``config.py``), hook plans
(``_fanout.py``, ``_hooks.py``), events, metadata and stats. The public name
is ``kvmux.KvmuxConnector``; the rules live in the Rust core (``rust/mux/``).
"""
