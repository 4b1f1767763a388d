"""Types of kvmux's Rust core (``kvmux._core``)."""

from collections.abc import Callable, Iterable
from typing import Any

from typing_extensions import Self, final

# PyO3 lists every name the module adds in ``__all__``.
__all__ = [
    "BY_CHILD_KEY",
    "CHILD_COUNTERS",
    "CLASH_POLICIES",
    "EXTRA_KEY",
    "LOAD_POLICIES",
    "LOCAL_KEY",
    "MAX_CHILDREN",
    "TOTAL_COUNTERS",
    "HostIndex",
    "Mux",
    "Reservation",
    "ServablePrefix",
    "bind_errors",
    "chain_token_hashes",
]

CLASH_POLICIES: list[str]
LOAD_POLICIES: list[str]
MAX_CHILDREN: int
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

@final
class Mux:
    """The multiplexer (``rust/mux.rs``) over its children's hooks. On the
    scheduler side its hook methods are bound on the connector instance:
    vLLM's call goes straight into Rust."""

    def __new__(
        cls,
        names: list[str],
        clash_policy: str,
        load_policy: str,
        block_size: int,
        hooks: dict[str, list[tuple[bool, Any]]],
        hma: list[bool],
        logger: Any,
        hma_fix: str,
        glue: dict[str, Any] | None = None,
        lookup_timeouts_ms: list[float | None] | None = None,
        breakers: list[tuple[int, float, float] | None] | None = None,
        load_timeouts_ms: list[float | None] | None = None,
    ) -> Self:
        """``hooks``: hook name -> per child ``(True, bound method)`` to call
        it or ``(False, its constant answer)``; a hook left out is answered by
        every child with vLLM's default. ``hma[i]``: child i supports HMA.
        ``logger`` gets the clash and containment warnings; ``hma_fix`` is
        the fix named when a multi-group request meets a non-HMA child;
        ``glue`` (scheduler side) holds ``metadata``, ``worker_metadata``,
        ``stats`` and ``stats_every_s`` for the per-step hooks;
        ``lookup_timeouts_ms[i]``: child i's lookup deadline (None: none);
        ``breakers[i]``: child i's breaker ``(failures, cooldown_ms,
        max_cooldown_ms)`` (None: none); ``load_timeouts_ms[i]``: child i's
        async load deadline (None: none)."""
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
    def chosen(self, req_id: str) -> int | None:
        """The child chosen to load a request, if any."""
    def hit_sources(
        self,
        req_id: str,
        num_external_tokens: int,
        split: Callable[[int, int], list[tuple[str, int]] | None],
        own: list[str],
    ) -> list[tuple[str, int]]:
        """vLLM's hits-by-source split of a request's external tokens: each
        child that supplied a span of them splits it (``split(i, span)``; a
        child's own source ``own[i]`` for None or a wrong sum), summed."""
    def joined_requests(self) -> int:
        """Requests aborted while waiting for their asynchronous load beside
        an asynchronous save, whose last completion vLLM still waits for."""
    def on_new_request(self, request: Any) -> None: ...
    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's hook: ``glue["metadata"](children's metadata, saves,
        loads, load_blocks)``, the completions the workers wait for."""
    def update_connector_output(self, connector_output: Any) -> None:
        """vLLM's hook: failed loads stop counting as loaded; each child sees
        its own slice of the workers' metadata."""
    def get_kv_connector_stats(self) -> Any:
        """vLLM's hook: ``glue["stats"](names, child stats, counters)`` at most
        once per ``glue["stats_every_s"]`` and when idle, and at once when a
        breaker changed state (``counters["breaker_state"]``: child name ->
        0 closed, 1 half open, 2 open); None if quiet."""
    def expect(
        self,
        saves: dict[str, tuple[int, int]] | None = None,
        loads: dict[str, int] | None = None,
        load_blocks: dict[str, list[int]] | None = None,
    ) -> None:
        """Worker side: the completions the metadata announces (``saves``:
        request id -> (bit set of the saving children, completions needed);
        ``loads``: request id -> bit set of the async loaders;
        ``load_blocks``: request id -> the blocks a load by a child with a
        load deadline writes, reported as load errors if it misses it)."""
    def complete_sends(self, per_child: Iterable[Iterable[str] | None]) -> set[str]:
        """Worker side: each child's finished-sending ids (config order) ->
        the requests finished sending now; strays dropped and counted."""
    def complete_recvs(self, per_child: Iterable[Iterable[str] | None]) -> set[str]:
        """Worker side (vLLM without ``get_transfer_results``): each child's
        finished receiving ids -> the requests every async loader has
        reported, and those whose load missed a child's load deadline
        (their blocks: :meth:`take_timed_out_blocks`); strays dropped and
        counted."""
    def take_timed_out_blocks(self) -> list[int]:
        """Worker side: blocks of loads that missed their load deadline
        since the last call."""
    def complete_recv_results(
        self, per_child: Iterable[tuple[Iterable[str] | None, Iterable[str] | None]]
    ) -> tuple[set[str], set[str]]:
        """Worker side: each child's ``(finished_recving, failed_recving)``
        -> ``(finished, failed)``: the requests every async loader has
        reported, and those of them one of whose loaders failed or missed
        its load deadline (in both).
        A failed id is one completion of its child, listed in both sets or
        in ``failed_recving`` only; strays dropped and counted."""
    def pending_sends(self) -> int: ...
    def pending_recvs(self) -> int: ...
    def count_load_failures(self, blocks: int) -> None: ...
    def stats(self) -> dict[str, Any]:
        """Cumulative counters plus ``live_requests`` and ``breakers``
        (child name -> ``"closed"``, ``"open"`` or ``"half_open"``, for the
        children that have one)."""
    def take_interval(self, every_s: float = 0.0) -> dict[str, Any] | None:
        """Counters changed since the previous take (nested, no zeros,
        ``clashes`` by policy); None when nothing changed. With ``every_s``,
        only once that many seconds passed or when no request is live."""
    def __len__(self) -> int: ...

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
    """The host tier's block index: block hash -> slot, LRU, pins; one key
    space per KV cache group, one pool of slots and one LRU order. Each
    slot's owner (the request saving into it) and the workers'
    acknowledgements are here too, and what it stores, aborts, evicts and
    drops it reports as events (:meth:`take_events`)."""

    def __new__(cls, capacity: int, groups: int = 1, workers: int = 1) -> Self:
        """``capacity`` slots shared by ``groups`` key spaces (one per KV
        cache group); each save and load needs an acknowledgement from each
        of ``workers`` workers."""
    @property
    def capacity(self) -> int: ...
    @property
    def groups(self) -> int: ...
    @property
    def workers(self) -> int: ...
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
    def reserve(self, keys: list[bytes], group: int = 0, owner: str | None = None) -> Reservation:
        """Reserve slots for ``owner`` (a request id) to save ``group``'s
        uncached ``keys``; a ready block evicted for room is an ``evicted``
        event."""
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

def chain_token_hashes(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """Chained 128-bit hashes of the full blocks of ``tokens``."""
