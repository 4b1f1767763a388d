"""kvmux's exceptions: each says what is wrong and how to fix it."""

from __future__ import annotations

from collections.abc import Sequence

from kvmux import _core

__all__ = ["KvmuxChildError", "KvmuxConfigError", "KvmuxParamClash"]


class KvmuxConfigError(ValueError):
    """A ``kv_transfer_config`` kvmux cannot run with.

    Raised at construction (and by ``python -m kvmux doctor``). The message
    names every problem found, each with its fix; ``problems`` holds them one
    per item.
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
    ``clash_policy`` refuses it."""

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

    ``child`` is the child's name, ``hook`` the connector method.
    """

    def __init__(self, child: str, hook: str, detail: str) -> None:
        self.child, self.hook, self.detail = child, hook, detail
        super().__init__(f"kvmux child {child!r} failed in {hook}: {detail}")


# The Rust core raises these (its one error type maps onto them, once).
_core.bind_errors(KvmuxChildError, KvmuxParamClash, KvmuxConfigError)
