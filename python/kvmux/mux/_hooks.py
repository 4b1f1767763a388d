"""How a connector hook is resolved to the object that runs it.

The hot hooks of :class:`~kvmux.mux.connector.KvmuxConnector` have no Python
body of kvmux's: a scheduler hook is the Rust ``SchedulerMux``'s method of
the same name (vLLM's call goes straight into Rust), and a per-layer hook is
the one child's bound method that does something. Each is declared on the
connector class as a descriptor of this module, with its contract as its
docstring, so a reader finds it by grep where the other hooks are.

A descriptor resolves its hook on the first access and keeps the result on
the instance, as :func:`functools.cached_property` keeps its value: later
accesses are a plain attribute read, with no frame. What the instance keeps
is what the descriptor returns; no method of a different body is shadowed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvmux.errors import KvmuxChildError

__all__ = [
    "AnyChildHook",
    "LayerHook",
    "QuietHook",
    "SchedulerHook",
    "StatsHook",
]


class _ResolvedHook:
    """A hook resolved once per instance by :meth:`resolve`."""

    name: str

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def resolve(self, connector: Any) -> Callable[..., Any]:
        raise NotImplementedError

    def __get__(self, connector: Any, owner: type | None = None) -> Any:
        if connector is None:
            return self
        fn = self.resolve(connector)
        connector.__dict__[self.name] = fn
        return fn

    def __call__(self, connector: Any, *args: Any, **kwargs: Any) -> Any:
        """Called through the class (``KvmuxConnector.hook(conn, ...)``)."""
        return self.__get__(connector)(*args, **kwargs)


class SchedulerHook(_ResolvedHook):
    """A scheduler-side hook that is the Rust ``SchedulerMux``'s method of
    the same name (``kvmux._core.SCHEDULER_HOOKS``)."""

    def resolve(self, connector: Any) -> Callable[..., Any]:
        return getattr(connector._scheduler_mux, self.name)


class StatsHook(_ResolvedHook):
    """``get_kv_connector_stats``, on either side. On the scheduler: the
    Rust ``SchedulerMux``'s method, which builds the ``KvmuxStats`` itself
    (None when it has nothing to report). On a worker: the worker's
    method."""

    def resolve(self, connector: Any) -> Callable[..., Any]:
        if connector._scheduler is None:
            return getattr(connector._work(self.name), self.name)
        return getattr(connector._scheduler_mux, self.name)


class LayerHook(_ResolvedHook):
    """A per-layer worker hook: only the children whose hook does something
    are called, a single one directly, with no wrapper frame
    (:func:`kvmux.mux._fanout.layer_hook`). On that path a child's exception
    reaches vLLM as the child raised it, not as ``KvmuxChildError``: naming
    it would cost a frame per layer per step."""

    def resolve(self, connector: Any) -> Callable[..., Any]:
        return connector._children.layer_hook(self.name)


class QuietHook(_ResolvedHook):
    """A per-step hook whose answer is empty when no child's hook does
    anything (every child lacks it or only returns an empty constant):
    then it is ``empty`` itself, a builtin that answers the empty value
    with no frame (``tuple``: ``()``; ``bool``: ``False``). Otherwise it is
    the connector's method named ``combine``, which asks the children."""

    def __init__(self, doc: str, empty: Callable[[], Any], combine: str) -> None:
        super().__init__(doc)
        self.empty = empty
        self.combine = combine

    def resolve(self, connector: Any) -> Callable[..., Any]:
        if connector._children.silent(self.name):
            return self.empty
        return getattr(connector, self.combine)


class AnyChildHook(_ResolvedHook):
    """A scheduler-side question answered true when any child's answer is
    (``may_load_async``). Children whose hook only returns a constant are
    not asked: when none is left, the hook is a builtin that answers that
    constant with no frame (``().__contains__`` answers False for any
    argument); when one is left, it is that child's bound method; otherwise
    a function that asks each of them in config order and stops at the
    first true answer. A child that raises is named
    (:class:`~kvmux.errors.KvmuxChildError`)."""

    def resolve(self, connector: Any) -> Callable[..., Any]:
        children = connector._children
        plan = children.plan(self.name)
        if any(plan.answers):
            return _always_true
        if not plan.active:
            return ().__contains__
        if len(plan.active) == 1:
            return plan.active[0][1]
        hook, names, active = self.name, children.names, plan.active

        def any_child(*args: Any, **kwargs: Any) -> bool:
            for i, fn in active:
                try:
                    if fn(*args, **kwargs):
                        return True
                except Exception as e:
                    raise KvmuxChildError(names[i], hook, f"{type(e).__name__}: {e}") from e
            return False

        any_child.__name__ = hook
        return any_child


def _always_true(*args: Any, **kwargs: Any) -> bool:
    return True
