"""Failures of children on requests they never took part in, contained.

vLLM calls every connector's ``request_finished`` (or
``request_finished_all_groups``, and before it ``register_finished_partial_tail``)
for every request that ends, including one aborted while still waiting,
before any connector looked it up. Some children cannot handle a request
they have never seen: LMCache's ``LMCacheMPConnector`` fails its tracker
lookup (``AssertionError``, or ``KeyError`` under ``python -O``) when such a
request asked for ``cached_token_stats``. Raised out of the scheduler, that
kills the engine core: one client disconnect would take the server down.

kvmux knows, per request and per child, whether the child took part (was
asked to look the request up, or was given its blocks: the Rust core's
``took_part``). On a request's way out:

- a child that never took part and raises is *contained*: logged (a warning
  the first time per child, naming the child, the hook and the request;
  debug after that), counted in the child's ``contained_errors``, and
  treated as "no async save, no params"; every other child is still called
  and kvmux's own params are still returned;
- a child that did take part and raises still fails the call with
  :class:`~kvmux.errors.KvmuxChildError` naming it, after every other child
  has been told the request finished (so none of them leaks state for it).

A contained child was not counted as saving the request asynchronously, so
vLLM frees the request's blocks at once; a child whose worker still reports
the request "finished sending" (LMCache's does, for every finished request)
must not have that reported to vLLM, which no longer knows the request. The
scheduler side therefore sends, with the next metadata, the children whose
completions of the request the workers drop (:class:`DroppedSaves`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from typing import Any

from kvmux._fanout import fanout_plan
from kvmux.errors import KvmuxChildError

__all__ = ["DroppedSaves", "call_children_on_exit", "call_each_on_exit"]

logger = logging.getLogger("kvmux")


def call_children_on_exit(
    mux: Any, hook: str, request: Any, args: tuple[Any, ...], default: Any
) -> tuple[list[Any], list[int] | None]:
    """Call ``hook(request, *args)`` on every child, for a request on its way
    out. Returns every child's answer (``default`` for a contained failure)
    and the indices of the contained children (None when none was); raises
    the first failure of a child that took part, after calling all of them."""
    # As kvmux._fanout.call_children: children whose hook only returns a
    # constant are not called.
    plan = fanout_plan(mux, hook)
    answers = list(plan.answers)
    if not plan.active:
        return answers, None
    return _call_on_exit(
        mux, request, ((i, hook, fn, args) for i, fn in plan.active), answers, default
    )


def call_each_on_exit(
    mux: Any, routes: Sequence[tuple[str, tuple[Any, ...]]], request: Any, default: Any
) -> tuple[list[Any], list[int] | None]:
    """As :func:`call_children_on_exit`, with a hook and arguments of its own
    for each child: ``routes[i]`` is ``(hook, args)`` for child ``i`` (e.g.
    ``request_finished_all_groups`` for a child with HMA support and
    ``request_finished`` with the one group's blocks for a child without)."""
    answers: list[Any] = []
    calls = []
    for i, (hook, args) in enumerate(routes):
        plan = fanout_plan(mux, hook)
        answers.append(plan.answers[i])
        fn = next((fn for j, fn in plan.active if j == i), None)
        if fn is not None:
            calls.append((i, hook, fn, args))
    return _call_on_exit(mux, request, calls, answers, default)


def _call_on_exit(
    mux: Any,
    request: Any,
    calls: Iterable[tuple[int, str, Any, tuple[Any, ...]]],
    answers: list[Any],
    default: Any,
) -> tuple[list[Any], list[int] | None]:
    req_id = request.request_id
    contained: list[int] | None = None
    error: KvmuxChildError | None = None
    for i, hook, fn, args in calls:
        try:
            answers[i] = fn(request, *args)
        except Exception as cause:
            e = KvmuxChildError(mux._names[i], hook, f"{type(cause).__name__}: {cause}")
            e.__cause__ = cause
            answers[i] = default
            if mux._core.took_part(req_id, i):
                error = error or e
            else:
                _contain(mux, i, hook, req_id, e)
                contained = (contained or []) + [i]
    if error is not None:
        raise error
    return answers, contained


def _contain(mux: Any, i: int, hook: str, req_id: str, e: KvmuxChildError) -> None:
    mux._core.count_contained(i)
    first = i not in mux._contained_warned
    mux._contained_warned.add(i)
    logger.log(
        logging.WARNING if first else logging.DEBUG,
        "kvmux: child %r failed in %s for request %r, which it never took part in "
        "(it ended before the child looked it up); contained: no async save, no params "
        "from this child, counted in its contained_errors%s. Cause: %s",
        mux._names[i],
        hook,
        req_id,
        " (warned once per child; later ones at debug level)" if first else "",
        e.detail,
    )


class DroppedSaves:
    """Worker side: completions to drop, ``{request id: {child index}}``, for
    requests whose save a contained child was not counted for. An entry goes
    once every child in it has reported the request."""

    def __init__(self) -> None:
        self._drop: dict[str, set[int]] = {}

    def __len__(self) -> int:
        return len(self._drop)

    def expect(self, dropped: dict[str, Iterable[int]]) -> None:
        for req_id, children in dropped.items():
            self._drop.setdefault(req_id, set()).update(children)

    def filter(self, child: int, finished_sending: Iterable[str] | None) -> list[str]:
        """``finished_sending`` of child ``child``, less the dropped ones."""
        if not finished_sending:
            return []
        if not self._drop:
            return list(finished_sending)
        out = []
        for req_id in finished_sending:
            children = self._drop.get(req_id)
            if children is None or child not in children:
                out.append(req_id)
                continue
            children.discard(child)
            if not children:
                del self._drop[req_id]
        return out
