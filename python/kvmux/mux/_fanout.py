"""Which child hooks need not be called: the answer is known.

A child whose hook only returns a constant (vLLM's base-class defaults,
``pass``, ``return 0, False``) has no effect when called and always gives
the same answer, so :class:`kvmux.mux.children.Children` does not call it (see
:func:`constant_answer`). On the per-layer path, :func:`layer_hook` binds
the connector's hook to the one child that does something, with no wrapper
frame at all.
"""

from __future__ import annotations

import dis
import inspect
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["constant_answer", "layer_hook"]


_TRIVIAL = {"RESUME", "NOP", "CACHE", "EXTENDED_ARG"}
_IMMUTABLE = (type(None), bool, int, float, str, bytes)


def _immutable(value: Any) -> bool:
    if isinstance(value, tuple):
        return all(_immutable(v) for v in value)
    return isinstance(value, _IMMUTABLE)


def _constant_code(func: Any) -> tuple[bool, Any]:
    func = getattr(func, "__func__", func)
    code = getattr(func, "__code__", None)
    if code is None:
        return False, None
    ops = [(i.opname, i.argval) for i in dis.get_instructions(code) if i.opname not in _TRIVIAL]
    if len(ops) == 1 and ops[0][0] == "RETURN_CONST":
        value = ops[0][1]
    elif len(ops) == 2 and ops[0][0] == "LOAD_CONST" and ops[1][0] == "RETURN_VALUE":
        value = ops[0][1]
    else:
        return False, None
    return (True, value) if _immutable(value) else (False, None)


def constant_answer(hook: Any) -> tuple[bool, Any]:
    """``(True, value)`` when the bound method ``hook``'s body only returns
    the immutable constant ``value`` (``pass``, ``return 0, False``, a
    docstring): calling it has no effect and answers ``value``, so the
    multiplexer need not call it. ``(False, None)`` for anything else,
    including callables set on the instance and wrapped functions."""
    if not inspect.ismethod(hook):
        return False, None
    return _constant_code(hook)


def layer_hook(active: Sequence[Callable[..., Any]], name: str) -> Callable[..., None]:
    """The fastest callable for a per-layer hook (``wait_for_layer_load``,
    ``save_kv_layer``) over ``active``, the hooks of the children the core's
    fan-out rule calls (:meth:`kvmux.mux.children.Children.plan`): none, a
    builtin that does nothing; one, that child's bound method itself, with no
    wrapper frame; several, one loop over them."""
    if not active:
        return _noop
    if len(active) == 1:
        return active[0]
    active_t = tuple(active)

    def fan(*args: Any, **kwargs: Any) -> None:
        for f in active_t:
            f(*args, **kwargs)

    fan.__name__ = name
    return fan


def _noop(*args: Any, **kwargs: Any) -> None:
    return None
