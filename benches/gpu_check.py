"""Check and time KvmuxHostCache's copy path on a GPU (or the CPU).

Needs only torch and the kvmux wheel (no vLLM), so it runs on any CUDA
machine::

    python benches/gpu_check.py                 # CUDA if present, else CPU
    python benches/gpu_check.py --device cpu --quick

1. Correctness: random KV blocks saved device->host into consecutive and into
   fragmented host slots, the device cache wiped, loaded back host->device
   into other blocks, compared bit for bit; for blocks-first and K/V-first
   layouts.
2. Bandwidth: ``HostPool.save`` / ``HostPool.load`` of one step's blocks over
   every layer, against a plain ``copy_`` of the same bytes between one
   contiguous device buffer and one (pinned) host buffer: the copy-engine
   limit. Prints GB/s and the ratio kvmux / plain copy.
3. Overlap (CUDA): a save must not block the current stream: a matmul issued
   right after ``save()`` finishes before the save does.

Exit status 0 only if every check passed (the round trips and, on CUDA, the
overlap).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kvmux.host_cache.transfer import HostPool


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, reps: int) -> list[float]:
    fn()  # warm-up
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return out


def make_kv(device, layers, blocks, heads, block_size, head, dtype, kv_first):
    shape = (
        (2, blocks, block_size, heads, head) if kv_first else (blocks, heads, block_size, 2 * head)
    )
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        f"layer.{i}": torch.randn(shape, device=device, dtype=dtype, generator=gen)
        for i in range(layers)
    }


def check_round_trip(device, dtype, kv_first: bool, block_size: int = 16) -> bool:
    kv = make_kv(device, 4, 64, 2, block_size, 64, dtype, kv_first)
    pool = HostPool(kv, num_blocks=64, num_slots=40)
    ok = True
    for slots in ([0, 1, 2, 3, 4, 5], [7, 3, 30, 31, 12, 20]):  # consecutive, fragmented
        src = [9, 2, 40, 41, 63, 0]
        want = {n: (t[:, src] if kv_first else t[src]).clone() for n, t in kv.items()}
        pool.save(src, slots).wait()
        for t in kv.values():
            t.zero_()
        dst = [10, 11, 12, 50, 51, 1]
        pool.load(slots, dst)
        _sync(device)
        for n, t in kv.items():
            got = t[:, dst] if kv_first else t[dst]
            ok &= torch.equal(got, want[n])
    return ok


def bandwidth(device, dtype, args) -> dict[str, float]:
    kv = make_kv(
        device,
        args.layers,
        args.blocks,
        args.heads,
        args.block_size,
        args.head,
        dtype,
        kv_first=False,
    )
    step = args.step_blocks
    pool = HostPool(kv, num_blocks=args.blocks, num_slots=step)
    gen = torch.Generator().manual_seed(1)
    blocks = torch.randperm(args.blocks, generator=gen)[:step].tolist()
    slots = list(range(step))
    nbytes = pool.block_bytes * step
    pin = device.type == "cuda"
    dev_flat = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    host_flat = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=pin)
    res = {}
    for name, kvmux_fn, plain_fn in (
        (
            "d2h",
            lambda: pool.save(blocks, slots).wait(),
            lambda: host_flat.copy_(dev_flat, non_blocking=pin),
        ),
        (
            "h2d",
            lambda: pool.load(slots, blocks).wait(),
            lambda: dev_flat.copy_(host_flat, non_blocking=pin),
        ),
    ):
        k = _timed(kvmux_fn, device, args.reps)
        p = _timed(plain_fn, device, args.reps)
        km, pm = statistics.median(k), statistics.median(p)
        res[f"{name}_kvmux_GBps"] = nbytes / km / 1e9
        res[f"{name}_plain_GBps"] = nbytes / pm / 1e9
        res[f"{name}_ratio"] = pm / km
        res[f"{name}_spread"] = (max(k) - min(k)) / km
    res["bytes_per_step"] = nbytes
    return res


def overlap(device, dtype, block_size: int = 16, tries: int = 5) -> bool:
    """Whether a matmul issued right after ``save()`` finishes while the save
    (256 MiB, milliseconds) is still running, in every one of ``tries``.
    The matmul and the save run once first: the first matmul of a process
    creates cuBLAS's handle, which takes longer than the whole save and
    would make the save look finished for the wrong reason."""
    blocks = 1024 * 16 // block_size
    kv = make_kv(device, 8, blocks, 8, block_size, 128, dtype, kv_first=False)
    pool = HostPool(kv, num_blocks=blocks, num_slots=blocks // 2)
    a = torch.randn(2048, 2048, device=device, dtype=dtype)
    src, slots = list(range(0, blocks, 2)), list(range(blocks // 2))
    (a @ a).sum()
    pool.save(src, slots).wait()
    _sync(device)
    pending = []
    for _ in range(tries):
        transfer = pool.save(src, slots)
        done = torch.cuda.Event()
        (a @ a).sum()
        done.record()
        done.synchronize()
        pending.append(not transfer.done())  # the matmul did not wait for the save
        transfer.wait()
        pool.fence()
    return all(pending)


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--blocks", type=int, default=4096, help="device KV blocks per layer")
    p.add_argument("--step-blocks", type=int, default=256, help="blocks moved per step")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--head", type=int, default=128)
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--quick", action="store_true", help="small sizes, a few reps")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args()
    if args.quick:
        args.layers, args.blocks, args.step_blocks, args.heads, args.head, args.reps = (
            4,
            256,
            32,
            2,
            64,
            3,
        )
    device = torch.device(args.device)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    results: dict[str, object] = {"device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)
    results["block_size"] = args.block_size
    results["round_trip_blocks_first"] = check_round_trip(
        device, dtype, kv_first=False, block_size=args.block_size
    )
    results["round_trip_kv_first"] = check_round_trip(
        device, dtype, kv_first=True, block_size=args.block_size
    )
    results.update(bandwidth(device, dtype, args))
    if device.type == "cuda":
        results["save_does_not_block_current_stream"] = overlap(device, dtype, args.block_size)
    for k, v in results.items():
        print(f"{k:>36}: {v:.3f}" if isinstance(v, float) else f"{k:>36}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    ok = results["round_trip_blocks_first"] and results["round_trip_kv_first"]
    ok = ok and results.get("save_does_not_block_current_stream", True)
    print("CORRECT" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
