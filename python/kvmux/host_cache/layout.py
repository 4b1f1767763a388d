"""What the host tier stores of each KV cache group, read once from vLLM's
``KVCacheConfig`` (the same on the scheduler and on every worker).

A plain model has one group; a hybrid model (Gemma 3, gpt-oss: sliding
window layers beside full attention) has several, each with its own block
table. Every group's blocks carry the same identity (vLLM's block hash of
the tokens), so the tier keys a block by (group, hash). What a later request
needs of a group to resume at a block boundary ``k`` decides what is worth
storing:

- full attention: every block before ``k``;
- sliding window of ``W`` tokens: only the blocks holding the ``W - 1``
  tokens before ``k`` (vLLM frees the others and leaves null blocks in their
  place), ``ceil((W - 1) / block_size)`` blocks;
- chunked local attention (Llama 4) is served as a window of its chunk
  size: a resume point needs at most the chunk before it.

vLLM overlays the groups on one allocation (a device block belongs to one
group at a time), so one host slot holds one block of any group, sized as
the largest group's block: the groups share the tier's capacity as they
share vLLM's own block pool, and the blocks a windowed group skips are room
for other blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvmux.errors import KvmuxConfigError

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

__all__ = ["FULL", "GroupLayout", "HostLayout", "NULL_BLOCK_ID", "host_layout"]

FULL = "full_attention"
SLIDING = "sliding_window"
CHUNKED = "chunked_local"

#: vLLM's null block (``BlockPool.null_block``, the pool's first block): the
#: placeholder a windowed group's block table holds where vLLM freed a block
#: outside the window, or never allocated one. It holds no KV to save or load.
NULL_BLOCK_ID = 0


@dataclass(frozen=True)
class GroupLayout:
    """One KV cache group as the host tier sees it."""

    index: int
    kind: str
    """``full_attention``, ``sliding_window`` or ``chunked_local``."""
    layer_names: tuple[str, ...]
    block_bytes: int
    """Bytes of one block of this group (all its layers)."""
    window_tokens: int | None = None
    """Tokens before a resume point the group reads (None: all of them)."""
    window_blocks: int | None = None
    """Blocks before a resume point the group reads (None: all of them)."""

    def describe(self) -> str:
        if self.window_tokens is None:
            return f"group {self.index} ({self.kind}, {len(self.layer_names)} layers): every block"
        return (
            f"group {self.index} ({self.kind} {self.window_tokens} tokens, "
            f"{len(self.layer_names)} layers): the {self.window_blocks} block(s) before each "
            "resume point"
        )


@dataclass(frozen=True)
class HostLayout:
    block_size: int
    groups: tuple[GroupLayout, ...]

    @property
    def slot_bytes(self) -> int:
        """Host bytes of one slot: one block of the largest group."""
        return max(g.block_bytes for g in self.groups)

    @property
    def windows(self) -> list[int | None]:
        """Per group, the blocks a resume point reads (None: the whole prefix)."""
        return [g.window_blocks for g in self.groups]

    @property
    def layer_groups(self) -> list[list[str]]:
        return [list(g.layer_names) for g in self.groups]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kind(spec: Any) -> tuple[str, int | None] | None:
    """(kind, window in tokens) of a spec the tier can serve, else None."""
    from vllm.v1 import kv_cache_interface as kci

    rswa = getattr(kci, "RSWASpec", None)
    if isinstance(spec, kci.SlidingWindowSpec):
        extra = int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return SLIDING, int(spec.sliding_window) + extra
    if isinstance(spec, kci.ChunkedLocalAttentionSpec):
        return CHUNKED, int(spec.attention_chunk_size)
    if isinstance(spec, kci.FullAttentionSpec) and not (rswa and isinstance(spec, rswa)):
        return FULL, None
    return None


def host_layout(kv_cache_config: KVCacheConfig, block_size: int) -> HostLayout:
    """The tier's view of ``kv_cache_config``; raises :class:`KvmuxConfigError`
    naming each group the tier cannot serve and the fix."""
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs

    groups: list[GroupLayout] = []
    problems: list[str] = []
    for i, group in enumerate(kv_cache_config.kv_cache_groups):
        spec = group.kv_cache_spec
        if isinstance(spec, UniformTypeKVCacheSpecs):
            kind = _kind(spec.first_spec)
            block_bytes = spec.page_size_bytes
        else:
            kind = _kind(spec)
            block_bytes = spec.page_size_bytes * len(group.layer_names)
        if kind is None:
            problems.append(
                f"KvmuxHostCache stores full-attention, sliding-window and chunked-local "
                f"attention KV; KV cache group {i} holds {type(spec).__name__} layers "
                f"({len(group.layer_names)} of them). Remove KvmuxHostCache from the "
                "connectors for this model"
            )
            continue
        if spec.block_size != block_size:
            problems.append(
                f"KvmuxHostCache: KV cache group {i} has {spec.block_size}-token blocks but "
                f"the engine's block size is {block_size}; the host tier keys blocks by the "
                "engine's block hashes and needs one block size. Run without "
                "KvmuxHostCache for this model"
            )
            continue
        name, window = kind
        groups.append(
            GroupLayout(
                index=i,
                kind=name,
                layer_names=tuple(group.layer_names),
                block_bytes=block_bytes,
                window_tokens=window,
                window_blocks=None if window is None else _cdiv(max(window - 1, 0), block_size),
            )
        )
    # vLLM hashes blocks every ``prefix_match_unit`` tokens when it is set
    # finer than a hybrid model's blocks: its i-th hash would then name a
    # prefix shorter than the tier's i-th block, and a request sharing only
    # that much would load another prompt's KV for the rest of the block.
    hash_block_size = getattr(kv_cache_config, "hash_block_size", None)
    if hash_block_size is not None and hash_block_size < block_size:
        problems.append(
            f"KvmuxHostCache keys {block_size}-token blocks by vLLM's block hashes, but "
            f"vLLM hashes every {hash_block_size} tokens (prefix_match_unit="
            f"{hash_block_size}); unset prefix_match_unit (or set it to {block_size}) "
            "or run without KvmuxHostCache"
        )
    if problems:
        raise KvmuxConfigError(problems)
    if not groups:
        raise KvmuxConfigError(
            "KvmuxHostCache: the KV cache config has no KV cache groups; nothing to store"
        )
    return HostLayout(block_size, tuple(groups))
