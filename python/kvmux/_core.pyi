"""Types of kvmux's Rust core (``kvmux._core``)."""

from collections.abc import Iterable

CLASH_POLICIES: list[str]
LOAD_POLICIES: list[str]
MAX_CHILDREN: int

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

class HostIndex:
    """The host tier's block index: block hash -> slot, LRU, pins."""

    def __init__(self, capacity: int) -> None: ...
    @property
    def capacity(self) -> int: ...
    def longest_prefix(self, keys: list[bytes]) -> int:
        """Leading blocks of ``keys`` ready to load."""
    def pin_ready(self, keys: list[bytes]) -> list[int] | None:
        """Pin the slots of ``keys`` for a load; None (nothing pinned) unless all are ready."""
    def reserve(self, keys: list[bytes]) -> tuple[list[int], list[int]]:
        """Reserve slots for the uncached ``keys``: (positions in keys, slots)."""
    def commit(self, slots: list[int]) -> int: ...
    def abort(self, slots: list[int]) -> int: ...
    def unpin(self, slots: list[int]) -> None: ...
    def clear_unpinned(self) -> int: ...
    def pins(self, slot: int) -> int: ...
    def check(self) -> None:
        """Raise RuntimeError naming the first broken invariant."""
    def stats(self) -> dict[str, int]: ...

def chain_token_hashes(tokens: list[int], block_size: int, seed: bytes) -> list[bytes]:
    """Chained 128-bit hashes of the full blocks of ``tokens``."""
