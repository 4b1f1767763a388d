"""P4: the host tier's copy path, save and load of one step's blocks, against
a plain contiguous torch copy of the same bytes (the memory-bandwidth limit).

- kvmux: ``HostPool.save`` (device blocks -> host slots) then ``HostPool.load``
  (host slots -> other device blocks), the code ``KvmuxHostCache``'s workers
  run, on vLLM's per-layer CPU layout ``(num_blocks, kv_heads, block_size,
  2 * head_size)``. Device blocks are scattered, as a busy block pool hands
  them out; host slots are consecutive, as a fresh pool hands them out.
- limit: per layer, one ``copy_`` of a contiguous buffer of the same size
  each way.

The figure is the limit's time over kvmux's (kvmux's fraction of the limit).

``--block-size`` (default 16; vLLM 0.34's GPU default is 64) sets the tokens
per block; the bytes per step stay those of 128 blocks of 16 tokens (64 MiB
each way at 16 layers): ``step_blocks = 128 * 16 / block_size`` (32 blocks at
64, rounded to the nearest block where it does not divide), the device pool
four steps' blocks. Fewer, larger blocks: fewer gathers and scatters for the
same bytes.
"""

from __future__ import annotations

import random

import torch

from benches.overhead.case import Case
from kvmux.host_cache.transfer import HostPool

__all__ = ["build"]


#: Tokens per step at every block size: 128 blocks of 16.
STEP_TOKENS = 128 * 16


def build(quick: bool, block_size: int = 16) -> Case:
    """``block_size``: tokens per block; the step moves about
    :data:`STEP_TOKENS` tokens' KV whatever it is."""
    if block_size <= 0:
        raise ValueError(f"P4: block size {block_size} is not positive")
    layers = 8 if quick else 16
    step_blocks = max(1, round(STEP_TOKENS / block_size))
    num_blocks = 4 * step_blocks
    kv_heads, head_size = 4, 128
    dtype = torch.bfloat16
    shape = (num_blocks, kv_heads, block_size, 2 * head_size)
    gen = torch.Generator().manual_seed(0)
    kv = {
        f"model.layers.{i}.self_attn.attn": torch.randn(shape, generator=gen).to(dtype)
        for i in range(layers)
    }
    pool = HostPool(kv, num_blocks=num_blocks, num_slots=step_blocks * 2)
    rng = random.Random(0)
    picked = rng.sample(range(num_blocks), 2 * step_blocks)
    src_blocks, dst_blocks = picked[:step_blocks], picked[step_blocks:]
    slots = list(range(step_blocks))

    def kvmux() -> None:
        pool.save(src_blocks, slots).wait()
        pool.load(slots, dst_blocks).wait()

    step_shape = (step_blocks, *shape[1:])
    dev = [torch.randn(step_shape, generator=gen).to(dtype) for _ in range(layers)]
    host = [torch.empty(step_shape, dtype=dtype) for _ in range(layers)]

    def limit() -> None:
        for d, h in zip(dev, host, strict=True):
            h.copy_(d)
        for d, h in zip(dev, host, strict=True):
            d.copy_(h)

    def check() -> None:
        kvmux()
        for t in kv.values():
            if not torch.equal(t[dst_blocks], t[src_blocks]):
                raise RuntimeError("the host tier did not copy the blocks back unchanged")

    step_bytes = pool.block_bytes * step_blocks
    return Case(
        key="P4",
        title=f"host-tier save+load of a step's blocks ({block_size}-token blocks)",
        kvmux=kvmux,
        rival=limit,
        rival_name="plain contiguous torch copy",
        unit=f"{step_blocks} blocks of {block_size} tokens x {layers} layers "
        f"({step_bytes / 2**20:.0f} MiB each way)",
        target=0.8,
        higher_is_better=True,
        inner=2 if quick else 5,
        check=check,
        notes={
            "layers": layers,
            "step_blocks": step_blocks,
            "block_size": block_size,
            "block_bytes_per_layer": pool.block_bytes // layers,
            "block_shape": list(shape[1:]),
            "dtype": str(dtype),
            "bytes_each_way": step_bytes,
            "torch_threads": torch.get_num_threads(),
        },
    )
