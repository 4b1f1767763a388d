"""Types of kvmux's Rust core (``kvmux._core``)."""

from collections.abc import Iterable

from typing_extensions import Self, final

# PyO3 lists every name the module adds in ``__all__``.
__all__ = [
    "CHILD_COUNTERS",
    "CLASH_POLICIES",
    "LOAD_POLICIES",
    "MAX_CHILDREN",
    "TOTAL_COUNTERS",
    "HostIndex",
    "MuxCore",
    "SaveCountdown",
    "ServablePrefix",
    "chain_token_hashes",
]

CLASH_POLICIES: list[str]
LOAD_POLICIES: list[str]
MAX_CHILDREN: int
CHILD_COUNTERS: list[str]
"""Names of kvmux's per-child counters, in the core's order (the one source
of the stats keys, the Prometheus table and the README's metric list)."""
TOTAL_COUNTERS: list[str]
"""Names of kvmux's multiplexer-wide counters, in the core's order."""

class MuxCore:
    """Scheduler-side state of one KvmuxConnector: one call per event."""

    def __init__(self, names: list[str], clash_policy: str, load_policy: str) -> None: ...
    def lookup(
        self,
        req_id: str,
        num_computed_tokens: int,
        answers: list[tuple[int | None, bool]],
    ) -> tuple[int | None, bool]:
        """Every child's ``get_num_new_matched_tokens`` answer in; the
        multiplexer's answer out. Raises ``KvmuxChildError`` on a malformed answer."""
    def allocated(self, req_id: str, num_external_tokens: int) -> int | None:
        """The child index that gets ``num_external_tokens`` (None: nobody)."""
    def chosen(self, req_id: str) -> int | None: ...
    def forget(self, req_id: str) -> bool:
        """Drop a request's state without counting it finished."""
    def took_part(self, req_id: str, child: int) -> bool: ...
    def loading(self, req_id: str) -> tuple[int, int] | None:
        """``(local prefix tokens, external tokens to load after them)`` of a
        live request whose load is planned; None when nothing loads."""
    def load_failed(self, req_id: str, failed_tokens: int) -> None:
        """Some of a request's external tokens failed to load: they no longer
        count in ``num_extra_cached_tokens``."""
    def finish(
        self,
        req_id: str,
        results: list[tuple[bool, dict[str, object] | None]],
        want_extra: bool,
    ) -> tuple[bool, dict[str, object] | None, int, list[tuple[str, str, str]] | None]:
        """``(async_save, merged params, extra async completions, new clash
        warnings (key, first child, second child))``. Raises ``KvmuxParamClash``."""
    def count_contained(self, child: int) -> None: ...
    def count_worker(self, finished_sending: int, load_failed_blocks: int) -> None: ...
    def stats(self) -> dict[str, object]:
        """Cumulative counters plus ``live_requests``."""
    def take_interval(self) -> dict[str, object] | None:
        """Counters changed since the previous call (nested, no zeros,
        ``clashes`` by policy); None when nothing changed."""
    def clear(self) -> None: ...
    def __len__(self) -> int: ...
    @property
    def clash_policy(self) -> str: ...
    @property
    def names(self) -> list[str]: ...

class SaveCountdown:
    """Worker-side countdown of async saves."""

    def __init__(self) -> None: ...
    def expect(self, extra: dict[str, int]) -> None: ...
    def complete(self, ids: Iterable[str]) -> set[str]: ...
    def pending(self) -> int: ...
    def __len__(self) -> int: ...

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
    space per KV cache group, one pool of slots and one LRU order."""

    def __new__(cls, capacity: int, groups: int = 1) -> Self:
        """``capacity`` slots shared by ``groups`` key spaces (one per KV
        cache group)."""
    @property
    def capacity(self) -> int: ...
    @property
    def groups(self) -> int: ...
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
    def reserve(self, keys: list[bytes], group: int = 0) -> tuple[list[int], list[int]]:
        """Reserve slots for ``group``'s uncached ``keys``: (positions in keys, slots)."""
    def commit(self, slots: list[int]) -> int: ...
    def abort(self, slots: list[int]) -> int: ...
    def unpin(self, slots: list[int]) -> None: ...
    def clear_unpinned(self) -> int: ...
    def pins(self, slot: int) -> int: ...
    def check(self) -> None:
        """Raise RuntimeError naming the first broken invariant."""
    def stats(self) -> dict[str, int]: ...
    def group_stats(self) -> list[dict[str, int]]:
        """Per group: ``writing``, ``ready``, ``stored``, ``evicted``, ``aborted``."""

def chain_token_hashes(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """Chained 128-bit hashes of the full blocks of ``tokens``."""
