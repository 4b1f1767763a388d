"""kvmux's exceptions: each says what is wrong, and a configuration error or
a refused params clash also how to fix it. The Rust core raises them too
(the classes are bound into it once, at import)."""

from __future__ import annotations

from collections.abc import Sequence

from kvmux import _core

__all__ = ["KvmuxChildError", "KvmuxConfigError", "KvmuxParamClash"]


class KvmuxConfigError(ValueError):
    """A ``kv_transfer_config`` kvmux cannot run with.

    Raised when ``KvmuxConnector`` or ``KvmuxHostCache`` is constructed (and
    by their ``validate_transfer_config``), and when a request of several KV
    cache groups finishes with a child that lacks HMA support (see
    ``KvmuxConnector.request_finished_all_groups``). ``python -m kvmux
    doctor`` reports the same problems without raising. The message names
    every problem found, each with its fix; ``problems`` holds them one per
    item.
    """

    def __init__(self, problems: str | Sequence[str]) -> None:
        self.problems: list[str] = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            msg = f"kvmux configuration error: {self.problems[0]}"
        else:
            lines = "\n".join(f"  - {p}" for p in self.problems)
            msg = f"kvmux configuration has {len(self.problems)} errors:\n{lines}"
        super().__init__(msg)


class KvmuxParamClash(RuntimeError):
    """Two children returned the same ``kv_transfer_params`` key and the
    ``clash_policy`` refuses it: ``error`` when the values differ, ``strict``
    always. ``key``, ``first`` and ``second`` (the two children's names) and
    ``policy`` say which."""

    def __init__(self, key: str, first: str, second: str, policy: str) -> None:
        self.key, self.first, self.second, self.policy = key, first, second, policy
        why = (
            "with different values"
            if policy == "error"
            else "and clash_policy 'strict' refuses any shared key"
        )
        super().__init__(
            f"kv_transfer_params key {key!r} was returned by both {first!r} and "
            f"{second!r} {why}. Fix: make the children use distinct keys, or set "
            f"kv_connector_extra_config['clash_policy'] to 'first' or 'last' to keep one."
        )


class KvmuxChildError(RuntimeError):
    """A child connector failed or returned something kvmux cannot use.

    ``child`` is the child's name, ``hook`` the connector method, ``detail``
    what went wrong; when the child raised, its exception is the
    ``__cause__``. On the per-layer hooks (``wait_for_layer_load``,
    ``save_kv_layer``) the child's own exception can reach vLLM unchanged
    (the README's "A child that raises is named" says when)."""

    def __init__(self, child: str, hook: str, detail: str) -> None:
        self.child, self.hook, self.detail = child, hook, detail
        super().__init__(f"kvmux child {child!r} failed in {hook}: {detail}")


# The Rust core raises these (its one error type maps onto them, once).
_core.bind_errors(KvmuxChildError, KvmuxParamClash, KvmuxConfigError)
