"""Failed loads reported by the workers stop counting as supplied tokens
(``kvmux._load_failures``, over the real Rust core)."""

from __future__ import annotations

from kvmux._core import MuxCore
from kvmux._load_failures import LoadWatch


class Blocks:
    """vLLM's ``KVCacheBlocks`` as far as ``get_block_ids`` goes."""

    def __init__(self, *groups: list[int]) -> None:
        self.groups = groups

    def get_block_ids(self) -> tuple[list[int], ...]:
        return self.groups


def planned_load(local: int, external: int, block_ids: list[int]):
    core = MuxCore(["a", "b"], "error", "first")
    core.lookup("r", local, [(0, False), (external, True)])
    core.allocated("r", external)
    watch = LoadWatch(block_size=16)
    watch.planned("r", Blocks(block_ids))
    return core, watch


def extra_tokens(core: MuxCore) -> int:
    return core.finish("r", [(False, None), (False, None)], True)[1]["num_extra_cached_tokens"]


def test_tokens_from_the_first_invalid_block_on_are_not_counted():
    # 16 local tokens (block 10), 48 loaded (blocks 11, 12, 13); block 12 fails.
    core, watch = planned_load(16, 48, [10, 11, 12, 13, 14])
    watch.check(core, {12, 99}, set())
    assert len(watch) == 0  # reported once
    assert extra_tokens(core) == 16


def test_a_failed_receive_loses_the_whole_load_once():
    core, watch = planned_load(0, 32, [3, 4, 5])
    watch.check(core, set(), {"r"})
    assert len(watch) == 0
    watch.check(core, {3}, {"r"})  # reported again: already accounted for
    assert extra_tokens(core) == 0


def test_errors_in_other_blocks_leave_the_load_alone():
    core, watch = planned_load(16, 32, [10, 11, 12, 13])
    watch.check(core, {10, 13, 50}, set())  # the local block and one past the load
    assert len(watch) == 1  # still watched
    assert extra_tokens(core) == 32
