"""The one fan-out mechanism of the multiplexer.

Most connector hooks only need "call every child, combine the answers". They
are listed once in :data:`FANOUT_HOOKS` (hook name -> how answers combine) and
installed on the connector class by :func:`install_fanout`. Only hooks the
installed vLLM's ``KVConnectorBase_V1`` defines are installed, so one kvmux
runs on every tested vLLM version. Hooks with real multiplexing logic (lookup,
allocation, finish, metadata, completions) are written out in
``connector.py`` but call children through :func:`call_children` too, so a
failing child is always named.

Children whose hook only returns a constant (vLLM's base-class defaults,
``pass``) are not called at all: their answer is known (see
:func:`constant_answer`). That is most hooks of most children, and the
multiplexer runs in every scheduler step.
"""

from __future__ import annotations

import abc
import dis
import inspect
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvmux.errors import KvmuxChildError

__all__ = [
    "FANOUT_HOOKS",
    "Hook",
    "active_children",
    "call_child",
    "call_children",
    "constant_answer",
    "fanout_plan",
    "install_fanout",
    "is_noop",
    "layer_hook",
]


class _Mux(Protocol):
    _children: Sequence[Any]
    _names: Sequence[str]


def call_children(mux: _Mux, hook: str, *args: Any, **kwargs: Any) -> list[Any]:
    """Call ``hook`` on every child in config order and return the answers.

    A child whose hook only returns a constant (``pass``, ``return 0, False``,
    vLLM's base-class defaults) is not called: its answer is that constant
    (see :func:`constant_answer`). An exception from a child reaches vLLM as
    :class:`KvmuxChildError` naming the child and the hook, chained to the
    original.
    """
    plan = fanout_plan(mux, hook)
    out = list(plan.answers)
    if not plan.active:
        return out
    for i, fn in plan.active:
        try:
            out[i] = fn(*args, **kwargs)
        except Exception as e:
            raise KvmuxChildError(mux._names[i], hook, f"{type(e).__name__}: {e}") from e
    return out


def active_children(mux: _Mux, hook: str) -> tuple[int, ...]:
    """Indices of the children whose ``hook`` does something (the others only
    return a constant and need not be called)."""
    return fanout_plan(mux, hook).indices


def call_child(mux: _Mux, i: int, hook: str, *args: Any, **kwargs: Any) -> Any:
    """Call ``hook`` on child ``i``, naming the child if it raises."""
    try:
        return getattr(mux._children[i], hook)(*args, **kwargs)
    except Exception as e:
        raise KvmuxChildError(mux._names[i], hook, f"{type(e).__name__}: {e}") from e


_UNSET = object()


@dataclass(frozen=True)
class _Plan:
    answers: tuple[Any, ...]
    """Each child's answer where it is a constant (None where it is not)."""
    active: tuple[tuple[int, Callable[..., Any]], ...]
    """(index, bound hook) of the children that must be called."""
    indices: tuple[int, ...]
    """The indices of ``active``."""
    fixed: Any = None
    """The combined answer when no child must be called and it is immutable
    (None, a bool, a number); ``_UNSET`` otherwise."""


def fanout_plan(mux: _Mux, hook: str) -> _Plan:
    """How to fan ``hook`` out over ``mux``'s children, decided on first use
    and kept on the multiplexer (its children do not change)."""
    try:
        return mux._fanout_plans[hook]  # type: ignore[attr-defined]
    except AttributeError:
        mux._fanout_plans = {}  # type: ignore[attr-defined]
    except KeyError:
        pass
    answers: list[Any] = []
    active = []
    for i, child in enumerate(mux._children):
        fn = getattr(child, hook, None)
        if fn is None:  # e.g. request_finished_all_groups of a child without HMA
            answers.append(None)
            continue
        const, value = constant_answer(fn)
        answers.append(value)
        if not const:
            active.append((i, fn))
    fixed: Any = _UNSET
    combine = FANOUT_HOOKS[hook].combine if hook in FANOUT_HOOKS else None
    if combine is not None and not active:
        value = combine(mux, list(answers))
        if value is None or isinstance(value, bool | int | float):
            fixed = value
        elif isinstance(value, list | tuple) and not value:
            fixed = ()  # e.g. no child has events: an empty, shareable answer
    plan = _Plan(tuple(answers), tuple(active), tuple(i for i, _ in active), fixed)
    mux._fanout_plans[hook] = plan  # type: ignore[attr-defined]
    return plan


def _none(_: Any, answers: list[Any]) -> None:
    return None


def _any(_: Any, answers: list[Any]) -> bool:
    return any(bool(a) for a in answers)


def _chain(_: Any, answers: list[Any]) -> list[Any]:
    return list(itertools.chain.from_iterable(a or () for a in answers))


def _first_not_none(_: Any, answers: list[Any]) -> Any:
    return next((a for a in answers if a is not None), None)


def _at_most_one(mux: Any, answers: list[Any]) -> Any:
    found = [(n, a) for n, a in zip(mux._names, answers, strict=True) if a is not None]
    if len(found) > 1:
        raise ValueError(
            f"kvmux children {[n for n, _ in found]} each provide a KV cache memory "
            "pool; the KV cache is allocated once and can live in one pool only. "
            "Configure a custom memory pool on at most one child."
        )
    return found[0][1] if found else None


def _agree(mux: Any, answers: list[Any]) -> int | None:
    if any(a is None for a in answers):
        return None
    counts = dict(zip(mux._names, answers, strict=True))
    if len(set(counts.values())) > 1:
        raise ValueError(
            f"kvmux children expect different finished counts {counts}; children "
            "whose completions are counted per worker differently cannot be combined"
        )
    return answers[0] if answers else None


def _merge_events(_: Any, answers: list[Any]) -> Any:
    merged = None
    for events in answers:
        if events is not None:
            merged = events if merged is None else merged.merge(events)
    return merged


def _all_not_false(_: Any, answers: list[Any]) -> bool:
    return all(a is not False for a in answers)


@dataclass(frozen=True)
class Hook:
    combine: Callable[[Any, list[Any]], Any]
    call_all: bool = False
    """Call every child even when one raises, then raise the first error."""


FANOUT_HOOKS: dict[str, Hook] = {
    # worker side
    "register_kv_caches": Hook(_none),
    "unregister_kv_caches": Hook(_none),
    "restore_kv_caches": Hook(_none),
    "set_host_xfer_buffer_ops": Hook(_none),
    "start_load_kv": Hook(_none),
    "wait_for_save": Hook(_none),
    "finish_forward": Hook(_none),
    "reset_capture_state": Hook(_none),
    "get_mem_pool_context": Hook(_at_most_one),
    "get_handshake_metadata": Hook(_first_not_none),
    "set_xfer_handshake_metadata": Hook(_none),
    "set_xfer_handshake_metadata_pp_aware": Hook(_none),
    "get_finished_count": Hook(_agree),
    "get_kv_connector_kv_cache_events": Hook(_merge_events),
    "shutdown": Hook(_none, call_all=True),
    # scheduler side
    "on_new_request": Hook(_none),
    "bind_gpu_block_pool": Hook(_none),
    "take_events": Hook(_chain),
    "has_pending_block_frees": Hook(_any),
    "has_pending_push_work": Hook(_any),
    "reset_cache": Hook(_all_not_false),
}


def _make(name: str, hook: Hook) -> Callable[..., Any]:
    if hook.call_all:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            plan = fanout_plan(self, name)
            answers, first_error = list(plan.answers), None
            for i, _ in plan.active:
                try:
                    answers[i] = call_child(self, i, name, *args, **kwargs)
                except Exception as e:
                    first_error = first_error or e
            if first_error is not None:
                raise first_error
            return hook.combine(self, answers)

    else:

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            plan = fanout_plan(self, name)
            if not plan.active and plan.fixed is not _UNSET:
                return plan.fixed  # every child answers a constant, and so do we
            return hook.combine(self, call_children(self, name, *args, **kwargs))

    method.__name__ = method.__qualname__ = name
    method.__doc__ = f"Fan ``{name}`` out to every child ({hook.combine.__name__.strip('_')})."
    return method


def install_fanout(base: type) -> Callable[[type], type]:
    """Class decorator: install every :data:`FANOUT_HOOKS` hook that ``base``
    defines and that the class does not write out itself."""

    def deco(cls: type) -> type:
        for name, hook in FANOUT_HOOKS.items():
            if hasattr(base, name) and name not in cls.__dict__:
                setattr(cls, name, _make(name, hook))
        abc.update_abstractmethods(cls)
        return cls

    return deco


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


def is_noop(func: Callable[..., Any]) -> bool:
    """True when ``func``'s body does nothing (``pass``, a docstring, ``return``
    or ``return None``): such a child hook is skipped on the per-layer path."""
    const, value = _constant_code(func)
    return const and value is None


def layer_hook(children: Iterable[Any], name: str) -> Callable[..., None]:
    """The fastest callable for a per-layer hook (``wait_for_layer_load``,
    ``save_kv_layer``): only children whose hook does something are called,
    a single one directly, with no wrapper frame. A hook that cannot be
    inspected on the child's class (a child whose class hands back another
    object from ``__new__``, as vLLM's tests build ``MagicMock`` children) is
    treated as active and called on the object."""
    active = [getattr(c, name) for c in children if not _class_hook_is_noop(c, name)]
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


def _class_hook_is_noop(child: Any, name: str) -> bool:
    func = getattr(type(child), name, None)
    return func is not None and is_noop(func)


def _noop(*args: Any, **kwargs: Any) -> None:
    return None
