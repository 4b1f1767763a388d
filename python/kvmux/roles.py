"""A connector's two sides: vLLM builds each connector once per role (the
scheduler's, and one per worker), and a hook called on the side it was not
built for is a programming error in the host. One wording for every kvmux
connector (``KvmuxConnector`` and ``KvmuxHostCache``): :func:`wrong_role`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["WrongRole", "wrong_role"]

#: Each side's wrong role and where its hooks belong, for :func:`wrong_role`.
_ROLES = {
    "scheduler": ("worker", "the scheduler's connector"),
    "worker": ("scheduler", "a worker's connector"),
}


def wrong_role(hook: str, side: str, connector: str = "KvmuxConnector") -> RuntimeError:
    """The error of calling ``side``'s ``hook`` on a ``connector`` built for
    the other role."""
    role, where = _ROLES[side]
    return RuntimeError(
        f"kvmux: {hook} is a {side}-side hook, and this {connector} was "
        f"built for the {role} role; call it on {where}"
    )


class WrongRole:
    """Stands for the side a connector was not built for: any use of it
    (a hook's name, as the connector's side objects keep vLLM's names)
    raises :func:`wrong_role`."""

    def __init__(self, side: str, connector: str = "KvmuxConnector") -> None:
        self._side = side
        self._connector = connector

    def __getattr__(self, hook: str) -> Any:
        raise wrong_role(hook, self._side, self._connector)
