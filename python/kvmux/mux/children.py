"""The children of one kvmux connector, and how a hook fans out to them.

:class:`Children` owns the child connectors (built in config order, with the
role of their parent), their names, and for every hook the *facts* of each
child's: it lacks the hook, the hook only returns a constant (vLLM's
base-class defaults, ``pass``, ``return 0, False``: see
:func:`kvmux.mux._fanout.constant_answer`), or it does something. Who is called
is the core's rule (``rust/mux/plan.rs``): the Rust multiplexer takes the
facts of its hooks, and :meth:`Children.plan` asks the same rule
(``_core.fan_out``) for the hooks kvmux calls from Python.

Every call it makes names the child when the child raises
(:class:`~kvmux.errors.KvmuxChildError`, chained to the child's error).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmux._core import fan_out
from kvmux._versions import DEFAULT_HIT_SOURCES
from kvmux.errors import KvmuxChildError, KvmuxConfigError
from kvmux.mux._fanout import constant_answer, layer_hook
from kvmux.mux.config import MuxConfig
from kvmux.mux.events import KvmuxKVEvents, deduplicated, labelled, own_worker_events
from kvmux.mux.example_storage import is_example_connector, model_identity, write_marker

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import (
        KVConnectorBase_V1,
        KVConnectorRole,
    )
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["Children", "Fact", "Plan"]

#: What kvmux knows of one child's hook: None (the child lacks it),
#: ``("constant", answer)`` (its body only returns ``answer``) or
#: ``("works", bound method)``.
Fact = tuple[str, Any] | None

logger = logging.getLogger("kvmux")


@dataclass(frozen=True)
class Plan:
    """How one hook fans out over the children."""

    answers: tuple[Any, ...]
    """Each child's answer where it is a constant (None where it is not, or
    where the child lacks the hook)."""
    active: tuple[tuple[int, Callable[..., Any]], ...]
    """(index, bound hook) of the children that must be called."""


#: Hooks whose vLLM default kvmux's core applies itself, without the call:
#: a child that keeps the default is not asked (vLLM's default split of a
#: child's hits is all of them under its own ``_cache_hit_source``, which
#: ``rust/mux/sources.rs`` counts for a child that answers nothing).
_CORE_APPLIES = {"get_external_cache_hit_sources": DEFAULT_HIT_SOURCES}


def _direct_hooks(child: Any) -> dict[str, Any]:
    """The hooks ``child`` lets a multiplexer call without its connector's
    frame (``KvmuxHostCache.kvmux_direct_hooks``); none for any other
    child (looked up on the class: a mock's attributes are not a promise)."""
    if getattr(type(child), "kvmux_direct_hooks", None) is None:
        return {}
    got = child.kvmux_direct_hooks()
    return got if isinstance(got, dict) else {}


class Children:
    """The child connectors of one kvmux connector, in config order."""

    def __init__(
        self,
        cfg: MuxConfig,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig | None,
    ) -> None:
        self.names: tuple[str, ...] = tuple(cfg.names)
        self.connectors: list[KVConnectorBase_V1] = []
        self._plans: dict[str, Plan] = {}
        try:
            for spec in cfg.children:
                child_config = spec.vllm_config_for(vllm_config)
                if is_example_connector(spec.cls) and getattr(role, "name", "") == "SCHEDULER":
                    ktc = child_config.kv_transfer_config
                    folder = ktc.get_from_extra_config("shared_storage_path", "") if ktc else ""
                    write_marker(str(folder), model_identity(vllm_config))
                try:
                    # vLLM (>= 0.32) types it required; kvmux passes on the None it got.
                    child = spec.cls(child_config, role, kv_cache_config)  # type: ignore[arg-type]
                except KvmuxConfigError as e:
                    # A child's own settings are wrong: still a config error
                    # (naming the key and the fix), now naming the child.
                    raise KvmuxConfigError(f"connector {spec.name!r}: {e}") from e
                except Exception as e:
                    raise KvmuxChildError(spec.name, "__init__", f"{type(e).__name__}: {e}") from e
                self.connectors.append(child)
        except BaseException:
            self.shutdown_quietly()
            raise
        #: Per child, the hooks it lets kvmux call on its side object directly.
        self._direct: list[dict[str, Any]] = [_direct_hooks(c) for c in self.connectors]

    def __len__(self) -> int:
        return len(self.connectors)

    def shutdown_quietly(self) -> None:
        """Shut down every child built so far, logging failures (a start
        that failed half-way)."""
        for child in self.connectors:
            try:
                child.shutdown()
            except Exception:
                logger.exception("kvmux: shutting down a child after a failed start failed")
        self.connectors.clear()

    # ------------------------------------------------------------- plans

    def facts(self, hook: str) -> list[Fact]:
        """What kvmux knows of each child's ``hook``, in config order (see
        :data:`Fact`); a child's ``update_connector_output`` sees its own
        events container when children send KV events from their workers
        (:func:`kvmux.mux.events.own_worker_events`)."""
        out: list[Fact] = []
        applied = _CORE_APPLIES.get(hook)
        for child, direct in zip(self.connectors, self._direct, strict=True):
            fn = getattr(child, hook, None)
            if fn is None:  # e.g. request_finished_all_groups of a child without HMA
                out.append(None)
                continue
            if hook in direct:
                # kvmux's own host tier: its scheduler side, without the
                # connector's frame (KvmuxHostCache.kvmux_direct_hooks).
                out.append(("works", direct[hook]))
                continue
            if applied is not None and getattr(type(child), hook, None) is applied:
                # vLLM's own default, whose answer the core gives itself: as
                # if the child lacked the hook.
                out.append(None)
                continue
            const, value = constant_answer(fn)
            out.append(("constant", value) if const else ("works", fn))
        if (
            hook == "update_connector_output"
            and self.plan("get_kv_connector_kv_cache_events").active
        ):
            out = [
                ("works", own_worker_events(i, f[1])) if f is not None and f[0] == "works" else f
                for i, f in enumerate(out)
            ]
        return out

    def plan(self, hook: str) -> Plan:
        """How to fan ``hook`` out, decided by the core's rule on first use
        and kept (the children do not change)."""
        plan = self._plans.get(hook)
        if plan is not None:
            return plan
        facts = self.facts(hook)
        active, answers = fan_out(facts)
        plan = Plan(tuple(answers), tuple((i, facts[i][1]) for i in active))  # type: ignore[index]
        self._plans[hook] = plan
        return plan

    def active(self, hook: str) -> tuple[int, ...]:
        """Indices of the children whose ``hook`` does something."""
        return tuple(i for i, _ in self.plan(hook).active)

    def silent(self, hook: str) -> bool:
        """True when no child is called for ``hook`` and every child's
        constant answer is empty (None, False, ``()``)."""
        plan = self.plan(hook)
        return not plan.active and not any(plan.answers)

    def layer_hook(self, hook: str) -> Callable[..., None]:
        """The fastest callable for a per-layer hook (see
        :func:`kvmux.mux._fanout.layer_hook`)."""
        return layer_hook([fn for _, fn in self.plan(hook).active], hook)

    # ------------------------------------------------------------- calls

    def call(self, hook: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``hook`` on every child that must be called, in config order;
        every child's answer (the constant ones included)."""
        plan = self._plans.get(hook) or self.plan(hook)
        out = list(plan.answers)
        for i, fn in plan.active:
            try:
                out[i] = fn(*args, **kwargs)
            except Exception as e:
                raise KvmuxChildError(self.names[i], hook, f"{type(e).__name__}: {e}") from e
        return out

    def call_all(self, hook: str, *args: Any, **kwargs: Any) -> list[Any]:
        """As :meth:`call`, but every child is called even when one raises;
        then the first error is raised (for ``shutdown``)."""
        plan = self.plan(hook)
        out, first_error = list(plan.answers), None
        for i, _ in plan.active:
            try:
                out[i] = self.call_one(i, hook, *args, **kwargs)
            except KvmuxChildError as e:
                first_error = first_error or e
        if first_error is not None:
            raise first_error
        return out

    def call_one(self, i: int, hook: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``hook`` on child ``i``, naming the child if it raises."""
        try:
            return getattr(self.connectors[i], hook)(*args, **kwargs)
        except Exception as e:
            raise KvmuxChildError(self.names[i], hook, f"{type(e).__name__}: {e}") from e

    # ------------------------------------------------------ combinations

    def each(self, hook: str, *args: Any, **kwargs: Any) -> None:
        """Tell every child; nothing to combine."""
        if self.plan(hook).active:
            self.call(hook, *args, **kwargs)

    def any(self, hook: str, *args: Any, **kwargs: Any) -> bool:
        """True when any child answers true."""
        plan = self.plan(hook)
        answers = self.call(hook, *args, **kwargs) if plan.active else plan.answers
        return any(bool(a) for a in answers)

    def all_not_false(self, hook: str, *args: Any, **kwargs: Any) -> bool:
        """False when any child answers False (None counts as success)."""
        plan = self.plan(hook)
        answers = self.call(hook, *args, **kwargs) if plan.active else plan.answers
        return all(a is not False for a in answers)

    def first_not_none(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """The first child's answer that is not None."""
        return next((a for a in self.call(hook, *args, **kwargs) if a is not None), None)

    def mem_pool_context(self) -> Any:
        """The one child's KV cache memory pool context; two are an error."""
        answers = self.call("get_mem_pool_context")
        found = [(n, a) for n, a in zip(self.names, answers, strict=True) if a is not None]
        if len(found) > 1:
            raise ValueError(
                f"kvmux children {[n for n, _ in found]} each provide a KV cache memory "
                "pool; the KV cache is allocated once and can live in one pool only. "
                "Configure a custom memory pool on at most one child."
            )
        return found[0][1] if found else None

    def agree(self, hook: str, *args: Any, **kwargs: Any) -> Any:
        """The children's common answer (None when any has none); different
        answers are an error."""
        answers = self.call(hook, *args, **kwargs)
        if any(a is None for a in answers):
            return None
        counts = dict(zip(self.names, answers, strict=True))
        if len(set(counts.values())) > 1:
            raise ValueError(
                f"kvmux children expect different finished counts {counts}; children "
                "whose completions are counted per worker differently cannot be combined"
            )
        return answers[0] if answers else None

    def worker_events(self) -> KvmuxKVEvents | None:
        """Worker side: each child's KV events container of the step
        (``get_kv_connector_kv_cache_events``), kept apart so that each
        child's scheduler side gets its own; None when no child has any."""
        hook = "get_kv_connector_kv_cache_events"
        if not self.plan(hook).active:
            return None
        per_child = self.call(hook)
        if all(c is None for c in per_child):
            return None
        return KvmuxKVEvents(per_child)

    def take_events(self) -> list[Any]:
        """Scheduler side: every child's KV cache events of the step, in
        config order, each labelled with its child's name, repeats that say
        nothing new dropped (:mod:`kvmux.mux.events`)."""
        out: list[Any] = []
        for name, events in zip(self.names, self.call("take_events"), strict=True):
            if events:
                out.extend(labelled(events, name))
        return deduplicated(out) if len(out) > 1 else out
