"""Types of kvmux's Rust core (``kvmux._core``)."""

from collections.abc import Iterable, Sequence
from typing import Any

from typing_extensions import Self, final

# PyO3 lists every name the module adds in ``__all__``.
__all__ = [
    "BY_CHILD_KEY",
    "CHILD_COUNTERS",
    "CLASH_POLICIES",
    "EXTRA_KEY",
    "HMA_FIX",
    "LOAD_DECISIONS",
    "SAVE_POLICIES",
    "DEFAULT_REUSE",
    "LOAD_POLICIES",
    "LOCAL_KEY",
    "MAX_CHILDREN",
    "SCHEDULER_HOOKS",
    "TOTAL_COUNTERS",
    "HostIndex",
    "KvmuxMetadata",
    "Reservation",
    "SchedulerMux",
    "ServablePrefix",
    "WorkerMux",
    "bind_errors",
    "chain_token_hashes",
    "check_breaker",
    "check_deadline",
    "fan_out",
    "hma_refusal",
]

CLASH_POLICIES: list[str]
LOAD_POLICIES: list[str]
LOAD_DECISIONS: list[str]
#: A child's ``save_policy`` besides a reuse threshold (an int >= 1):
#: ``"always"`` and ``"auto"`` (``rust/mux/admit.rs``).
SAVE_POLICIES: list[str]
#: The reuse threshold ``"auto"`` gives every child but the first.
DEFAULT_REUSE: int
"""The values of ``load_decision``: ``always`` (load whatever hits) and
``cost`` (load a span only when loading is expected faster than computing it:
``rust/mux/cost.rs``)."""
MAX_CHILDREN: int
HMA_FIX: str
"""How to run a multi-group model with children that lack HMA: the fix every
HMA refusal names (``rust/mux/hma.rs``)."""
EXTRA_KEY: str
BY_CHILD_KEY: str
"""A request's ``kv_transfer_params`` key asking for the tokens each child
and vLLM's local prefix cache supplied (``cached_tokens_by_child``)."""
LOCAL_KEY: str
"""vLLM's local prefix cache in that answer (``local_prefix_cache``)."""
CHILD_COUNTERS: list[str]
"""Names of kvmux's per-child counters, in the core's order (the one source
of the stats keys, the Prometheus table and the README's metric list)."""
TOTAL_COUNTERS: list[str]
"""Names of kvmux's multiplexer-wide counters, in the core's order."""

SCHEDULER_HOOKS: list[str]
"""vLLM's scheduler hooks that are :class:`SchedulerMux`'s own methods (the
one table the connector's declarations and this stub are checked against)."""

def fan_out(facts: list[tuple[str, Any] | None]) -> tuple[list[int], list[Any]]:
    """The core's fan-out rule for one hook kvmux calls from Python: from
    each child's fact (None: it lacks the hook; ``("constant", answer)``;
    ``("works", bound method)``), ``(indices of the children to call, every
    child's constant answer)``."""

def check_deadline(key: str, ms: float) -> tuple[str, str] | None:
    """None when ``ms`` is within the core's bounds for the deadline setting
    ``key`` (``lookup_timeout_ms``, ``load_timeout_ms``), else ``(key,
    rule)``: the rule worded for the user (``rust/mux/settings.rs``)."""

def hma_refusal(supports_hma: list[bool], names: list[str], groups: int | None) -> str | None:
    """The start-up refusal, with the hybrid KV cache manager on, of a model
    with ``groups`` KV cache groups (None: unknown): None when every child
    can follow it (``rust/mux/hma.rs``)."""

def check_breaker(
    failures: int, cooldown_ms: float, max_cooldown_ms: float
) -> tuple[str, str] | None:
    """None when a breaker's settings are within the core's bounds, else
    ``(key, rule)`` of the first that is not (``rust/mux/settings.rs``)."""
@final
class KvmuxMetadata:
    """Scheduler -> workers, once per step (``kvmux.mux.metadata``; a vLLM
    ``KVConnectorMetadata`` by registration). Read-only; pickles by value."""

    def __new__(
        cls,
        children: Any,
        saves: dict[str, tuple[int, int]] | None = None,
        loads: dict[str, int] | None = None,
        load_blocks: dict[str, list[int]] | None = None,
    ) -> Self: ...
    @property
    def children(self) -> tuple[Any, ...]:
        """Each child's own metadata, in config order."""
    @property
    def saves(self) -> dict[str, tuple[int, int]] | None:
        """Requests finished this step that children save asynchronously:
        request id -> (bit set of those children, how many of their
        completions the workers wait for)."""
    @property
    def loads(self) -> dict[str, int] | None:
        """Requests loading asynchronously from this step on: request id ->
        bit set of the children loading it asynchronously."""
    @property
    def load_blocks(self) -> dict[str, list[int]] | None:
        """Of those loaded by a child with a ``load_timeout_ms``: request id
        -> the device blocks the load writes (group 0)."""

@final
class SchedulerMux:
    """The scheduler side of the multiplexer (``rust/mux/scheduler/``)
    over its children's hooks. Its methods named in :data:`SCHEDULER_HOOKS`
    are the connector's: vLLM's call goes straight into Rust."""

    def __new__(
        cls,
        children: list[
            tuple[str, bool, float | None, float | None, tuple[int, float, float] | None]
        ],
        clash_policy: str,
        load_policy: str,
        block_size: int,
        hooks: dict[str, list[tuple[str, Any] | None]],
        logger: Any,
        stats_every_s: float = 1.0,
        hit_sources: tuple[dict[str, Any], list[str], Any] | None = None,
        stats_class: Any = None,
        load_decision: str = "always",
        timeline_sink: Any = None,
        save_policies: list[str | int] | None = None,
        scheduler_view: Any = None,
        save_table_blocks: int | None = None,
        transports: list[bool] | None = None,
    ) -> Self:
        """``children``: per child ``(name, supports_hma, lookup_timeout_ms,
        load_timeout_ms, breaker (failures, cooldown_ms, max_cooldown_ms))``
        (None: no deadline, no breaker); ``hooks``: hook name -> each
        child's fact (see :func:`fan_out`), a hook left out answered by
        every child with vLLM's default; ``logger`` gets the
        core's notices (containment, breakers, clashes); the counters reach
        vLLM at most once per ``stats_every_s`` and when idle;
        ``hit_sources``: vLLM's ``CacheHitSource`` members by value, each
        child's own source and the multiplexer's (None: a vLLM without the
        split, which never asks); ``stats_class``: what the stats hook wraps
        its data in (``KvmuxStats``; None: the dict itself);
        ``load_decision``: one of :data:`LOAD_DECISIONS`; ``timeline_sink``:
        called after a finish with the finished requests' timelines (a list
        of dicts, see :mod:`kvmux.mux.timeline`; None: none kept);
        ``save_policies``: each child's ``save_policy`` (one of
        :data:`SAVE_POLICIES` or a reuse threshold; None: ``"always"`` for
        every child); ``scheduler_view``: ``(scheduler_output, hidden) ->
        view``, the step without the requests in ``hidden`` (what a child
        declined a save gets in ``build_connector_meta``);
        ``save_table_blocks``: the admission table's capacity in blocks
        (None: 65536); ``transports``: per child, whether it is a P/D
        transport rather than a storage tier (``"auto"`` then takes every
        save for it, and the first storage tier is the first other child)."""
    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """vLLM's hook. Raises ``KvmuxChildError`` naming a failing child
        (one with a breaker is a logged, counted miss instead)."""
    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None: ...
    def request_finished(self, request: Any, block_ids: Any) -> tuple[bool, dict[str, Any] | None]:
        """Raises ``KvmuxParamClash`` or ``KvmuxChildError``."""
    def request_finished_all_groups(
        self, request: Any, block_ids: Any
    ) -> tuple[bool, dict[str, Any] | None]:
        """Raises ``KvmuxConfigError`` for several groups with a non-HMA child."""
    def register_finished_partial_tail(
        self, request: Any, block_ids: Any, partial_tail_offloads: Any
    ) -> bool: ...
    def on_new_request(self, request: Any) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> KvmuxMetadata:
        """vLLM's hook: every child's metadata and the completions the
        workers wait for."""
    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's hook: failed loads stop counting as loaded; each child sees
        its own entry of the workers' metadata."""
    def get_kv_connector_stats(self) -> Any:
        """vLLM's hook: None if quiet, else ``stats_class(data)``, ``data``
        being ``{"children": {name: stats}, "kvmux": counters}``, the
        counters at most once per ``stats_every_s`` and when idle, and at
        once when a breaker changed state (``counters["breaker_state"]``:
        child name -> 0 closed, 1 half open, 2 open); with the counters,
        ``counters["load_decision"]``: what the load decision learned, as in
        ``stats()``."""
    def chosen(self, req_id: str) -> int | None:
        """The child chosen to load a request, if any."""
    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        """vLLM's hook: each child that supplied a span of the request's
        external tokens splits it (a child keeping vLLM's default split is
        not called; its own source for a wrong answer), summed; vLLM's
        default for the multiplexer itself when no child loads."""
    def joined_requests(self) -> int:
        """Requests aborted while waiting for their asynchronous load beside
        an asynchronous save, whose last completion vLLM still waits for."""
    def stats(self) -> dict[str, Any]:
        """Cumulative counters plus ``live_requests`` and ``breakers``
        (child name -> ``"closed"``, ``"open"`` or ``"half_open"``, for the
        children that have one); ``load_decision`` when it measures
        (``load_decision: "cost"`` or a ``timeline_path``):
        ``{"compute_s_per_token": x, "children": {name: {"load_s": a,
        "load_s_per_token": b, "not_ready_wait_s": w,
        "not_ready_yield_tokens": y}}}``, each key once measured;
        ``save_table_blocks``: the blocks save admission counts now (0
        when every child takes every save)."""
    def __len__(self) -> int: ...

@final
class WorkerMux:
    """The worker side of the multiplexer (``rust/mux/worker.rs``): the
    completions the workers wait for, with each child's identity, and the
    worker's counters."""

    def __new__(cls, names: list[str], load_timeouts_ms: list[float | None]) -> Self:
        """``load_timeouts_ms[i]``: child i's async load deadline (None: none)."""
    def expect(
        self,
        saves: dict[str, tuple[int, int]] | None = None,
        loads: dict[str, int] | None = None,
        load_blocks: dict[str, list[int]] | None = None,
    ) -> None:
        """The completions the metadata announces (``saves``: request id ->
        (bit set of the saving children, completions needed); ``loads``:
        request id -> bit set of the async loaders; ``load_blocks``: request
        id -> the blocks a load by a child with a load deadline writes,
        reported as load errors if it misses it)."""
    def complete_sends(self, per_child: Iterable[Iterable[str] | None]) -> set[str]:
        """Each child's finished-sending ids (config order) -> the requests
        finished sending now; strays dropped and counted."""
    def complete_recvs(self, per_child: Iterable[Iterable[str] | None]) -> set[str]:
        """(vLLM without ``get_transfer_results``) each child's finished
        receiving ids -> the requests every async loader has reported, and
        those whose load missed a child's load deadline (their blocks:
        :meth:`take_timed_out_blocks`); strays dropped and counted."""
    def take_timed_out_blocks(self) -> list[int]:
        """Blocks of loads that missed their load deadline since the last
        call."""
    def complete_recv_results(
        self, per_child: Iterable[tuple[Iterable[str] | None, Iterable[str] | None]]
    ) -> tuple[set[str], set[str]]:
        """Each child's ``(finished_recving, failed_recving)`` -> ``(finished,
        failed)``: the requests every async loader has reported, and those of
        them one of whose loaders failed or missed its load deadline (in
        both). A failed id is one completion of its child, listed in both
        sets or in ``failed_recving`` only; strays dropped and counted."""
    def pending_sends(self) -> int: ...
    def pending_recvs(self) -> int: ...
    def count_load_failures(self, blocks: int) -> None: ...
    def stats(self) -> dict[str, Any]:
        """Cumulative counters plus ``live_requests`` (0) and ``breakers``
        (empty): a worker holds neither."""
    def take_interval(self) -> dict[str, Any] | None:
        """Counters changed since the previous take (nested, no zeros); None
        when nothing changed."""

def bind_errors(child: type[Exception], clash: type[Exception], config: type[Exception]) -> None:
    """Called once by ``kvmux.errors``: the exception classes the core raises."""
@final
class Reservation:
    """The answer of :meth:`HostIndex.reserve`."""

    @property
    def positions(self) -> list[int]:
        """Where in the keys each reserved slot's block is."""
    @property
    def slots(self) -> list[int]:
        """The slots reserved: Writing, pinned until ``commit`` or ``abort``."""
    @property
    def events(self) -> list[tuple[str, int, bytes, str | None]]:
        """What the index did since the last drain, this reservation's
        evictions last (as :meth:`HostIndex.take_events`)."""

@final
class ServablePrefix:
    """The answer of :meth:`HostIndex.servable_prefix`, in blocks."""

    @property
    def blocks(self) -> int:
        """The longest prefix every group can serve (``start`` when none)."""
    @property
    def prefix_blocks(self) -> int:
        """Where the full-attention groups' run of ready blocks ends."""

@final
class HostIndex:
    """The host tier's block index: block hash -> slot, eviction (``slru``
    or ``lru``, per-tenant shares), pins; one key space per KV cache group,
    one pool of slots and one eviction order. Each
    slot's owner (the request saving into it) and the workers'
    acknowledgements are here too, and what it stores, aborts, evicts and
    drops it reports as events (:meth:`take_events`)."""

    def __new__(
        cls,
        capacity: int,
        groups: int = 1,
        workers: int = 1,
        block_size: int = 16,
        windows: list[int | None] | None = None,
        promote: bool = True,
        eviction: str = "slru",
        tenant_max_share: float = 1.0,
    ) -> Self:
        """``capacity`` slots shared by ``groups`` key spaces (one per KV
        cache group); each save and load needs an acknowledgement from each
        of ``workers`` workers. ``windows``: per group, None for full
        attention, else the blocks it reads before a resume point (default:
        all full attention); ``promote``: save the blocks other children
        loaded too. The per-request table (``rust/host_tier/requests.rs``)
        uses ``block_size``, ``windows`` and ``promote``. ``eviction``:
        ``"slru"`` (blocks read back are protected from blocks written
        once) or ``"lru"``; ``tenant_max_share``: the most one tenant holds
        of the capacity while others want room, in (0, 1]. ValueError for
        another eviction or a share out of range."""
    @property
    def capacity(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def workers(self) -> int: ...
    @property
    def num_requests(self) -> int:
        """Requests the per-request table holds state for."""
    def lookup(
        self,
        req_id: str,
        keys: list[bytes],
        num_computed: int,
        num_tokens: int,
        prompt_tokens: int,
    ) -> int:
        """``get_num_new_matched_tokens``: the tokens beyond ``num_computed``
        every group can serve; the slots offered stay pinned until the
        allocation, a new lookup or :meth:`finished`."""
    def allocated(
        self,
        req_id: str,
        keys: list[bytes],
        block_ids: Sequence[Sequence[int]],
        num_external: int,
    ) -> tuple[int, list[int], int] | None:
        """``update_state_after_alloc``: ``(loaded_tokens, [blocks queued per
        group], load_errors)``; None when, in a model of several groups,
        vLLM allocated blocks the lookup did not offer (nothing queued)."""
    def take_loads(self) -> list[tuple[str, list[int], list[int], int, bool]]:
        """The loads allocated since the last call: ``(req_id, slots, device
        blocks, group, failed)``."""
    def saves_due(
        self, req_id: str, num_computed: int, num_scheduled: int, num_keys: int
    ) -> tuple[int, int] | None:
        """``build_connector_meta``, per scheduled request: the blocks
        ``(first, full)`` to save now, or None."""
    def reserve_saves(
        self,
        req_id: str,
        keys: list[bytes],
        first: int,
        block_ids: Sequence[Sequence[int]],
        tenant: str | None = None,
    ) -> tuple[
        list[tuple[int, list[int], list[int], list[int], list[tuple[str, int, bytes, str | None]]]],
        list[int],
        int,
    ]:
        """Reserve the saves of the blocks from ``first`` (``keys``: theirs;
        ``tenant``: the request's ``cache_salt``, None without one):
        ``([(group, positions, slots, device blocks, events)], skipped per
        group, promoted blocks)``."""
    def finished(self, req_id: str) -> tuple[bool, int, int, list[int], list[int]] | None:
        """``request_finished``: ``(async_save, loaded_tokens, saved_blocks,
        loaded per group, saved per group)``, None for a request never
        seen; its offer and unshipped loads are released."""
    def longest_prefix(self, keys: list[bytes], group: int = 0) -> int:
        """Leading blocks of ``keys`` whose ``group`` blocks are ready to load."""
    def servable_prefix(
        self, keys: list[bytes], start: int, end: int, windows: list[int | None]
    ) -> ServablePrefix:
        """The longest prefix of ``keys[:end]`` every group can resume from,
        the first ``start`` blocks being on the device; ``windows[g]``: None
        for a full-attention group, else the blocks it reads before the
        resume point."""
    def pin_ready(self, keys: list[bytes], group: int = 0) -> list[int] | None:
        """Pin the slots of ``group``'s ``keys`` for a load; None (nothing
        pinned) unless all are ready."""
    def reserve(
        self,
        keys: list[bytes],
        group: int = 0,
        owner: str | None = None,
        tenant: str | None = None,
    ) -> Reservation:
        """Reserve slots for ``owner`` (a request id) of ``tenant`` to save
        ``group``'s uncached ``keys``; a ready block evicted for room is an
        ``evicted`` event."""
    def ack_saves(self, acks: dict[int, int]) -> int:
        """Workers acknowledged saves (slot -> acknowledgements): the saves
        every worker acknowledged become ready (``stored`` events); returns
        how many."""
    def ack_loads(self, acks: dict[int, int]) -> None:
        """Workers acknowledged loads (slot -> acknowledgements): each
        ``workers`` acknowledgements of a slot release one load pin."""
    def saving(self, owner: str) -> int:
        """``owner``'s saves in flight."""
    def take_events(self) -> list[tuple[str, int, bytes, str | None]]:
        """What the index did since the last call, in order: ``(kind, group,
        key, owner)``, ``kind`` one of ``stored``, ``aborted``, ``evicted``
        and ``dropped`` (``owner`` None for the last two)."""
    def workers_reported(
        self, failed_saves: list[int], saved: dict[int, int], loaded: dict[int, int]
    ) -> list[tuple[str, int, bytes, str | None]]:
        """The workers' report of one step in one call: ``failed_saves``
        aborted, ``saved`` and ``loaded`` (slot -> acknowledgements)
        counted; the events since the last drain (:meth:`take_events`)."""
    def commit(self, slots: list[int]) -> int:
        """Complete saves into ``slots`` whatever the workers acknowledged."""
    def abort(self, slots: list[int]) -> int: ...
    def unpin(self, slots: list[int]) -> None: ...
    def clear_unpinned(self) -> int: ...
    def check(self) -> None:
        """Raise RuntimeError naming the first broken invariant."""
    def stats(self) -> dict[str, int]: ...
    def usage(self) -> tuple[int, int, int, list[int]]:
        """``(capacity, used, pinned, [used slots of each group])`` now (O(groups))."""
    def group_stats(self) -> list[dict[str, int]]:
        """Per group: ``writing``, ``ready``, ``stored``, ``evicted``, ``aborted``."""
    @property
    def policy(self) -> tuple[str, float]:
        """``(eviction, tenant_max_share)``."""
    def policy_usage(self) -> tuple[int, int, int, int, int]:
        """``(tenants holding a block, protected blocks, the protected list's
        target (adapted; 0 under lru), lifetime evictions by the share rule,
        lifetime evictions of blocks read back)`` now (O(1))."""
    def tenant_held(self, tenant: str) -> int:
        """The slots ``tenant`` holds (writing or ready)."""
    def is_protected(self, slot: int) -> bool:
        """Whether ``slot`` holds a block read back (protected under slru)."""

def chain_token_hashes(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """Chained 128-bit hashes of the full blocks of ``tokens``."""
