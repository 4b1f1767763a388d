"""Failures of children on requests they never took part in, contained.

vLLM calls every connector's ``request_finished`` (or
``request_finished_all_groups``, and before it ``register_finished_partial_tail``)
for every request that ends, including one aborted while still waiting,
before any connector looked it up. Some children cannot handle a request
they have never seen: LMCache's ``LMCacheMPConnector`` fails its tracker
lookup (``AssertionError``, or ``KeyError`` under ``python -O``) when such a
request asked for ``cached_token_stats``. Raised out of the scheduler, that
kills the engine core: one client disconnect would take the server down.

The Rust core knows, per request and per child, whether the child took part
(was asked to look the request up, or was given its blocks). On a request's
way out (``Mux::finish`` and ``Mux::partial_tail`` in ``rust/mux.rs``):

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
completions of the request the workers drop: :class:`DroppedSaves`, here.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = ["DroppedSaves"]


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
