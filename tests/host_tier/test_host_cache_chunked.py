"""``KvmuxHostCache`` with chunked prefills (a prompt longer than vLLM's
token budget per step, ``max_num_batched_tokens``, computed over several
steps), through vLLM's real v1 scheduler and real CPU tensors as the paged
KV cache (``tests.support.harness``).

A model runner samples nothing for a request whose prompt a step leaves
partly computed: vLLM's GPU model runner discards those tokens
(``discard_request_mask``: the sequence length after the step is below the
request's token count) and the scheduler appends only what the runner
returns. The simulator's stand-in runner once sampled a token for every
scheduled request, so a prefill chunked over several steps with
``max_tokens=1`` ended after its first chunk and its later chunks were never
computed (nor saved), which looked like a host-tier bug; the last test here
keeps the simulator honest.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.request import RequestStatus

from tests.support.harness import BLOCK_SIZE, KVTransferConfig, SchedulerSim, mux_config, scripted

PROMPT = [100 + t for t in range(8 * BLOCK_SIZE + 5)]  # 8 full blocks and 5 tokens


def host_cache() -> KVTransferConfig:
    return KVTransferConfig(
        kv_connector="KvmuxHostCache",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config={"num_blocks": 64},
    )


def under_kvmux() -> KVTransferConfig:
    host = {
        "kv_connector": "KvmuxHostCache",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_blocks": 64},
    }
    return mux_config([host, scripted()])


CONFIGS = {"alone": host_cache, "under kvmux": under_kvmux}


def tier(d: SchedulerSim) -> Any:
    """The host tier: the connector itself, or kvmux's first child."""
    children = getattr(d.connector, "children", None)
    return children[0] if children else d.connector


def assert_clean(d: SchedulerSim) -> None:
    host = tier(d)
    st = host.index_stats()
    assert st["pinned"] == 0 and st["writing"] == 0
    assert st["ready"] + st["free"] == st["capacity"]
    assert host.num_live_requests() == 0 and d.connector.num_live_requests() == 0
    assert not d.scheduler.requests


def run_chunks(d: SchedulerSim, req_id: str) -> list[int]:
    """Step until everything is finished; the tokens ``req_id`` got each step."""
    chunks = []
    for _ in range(200):
        if not d.scheduler.has_requests() and not d.scheduler.requests:
            return chunks
        so = d.step()
        if req_id in so.num_scheduled_tokens:
            chunks.append(so.num_scheduled_tokens[req_id])
    raise TimeoutError(f"not drained; still holding {sorted(d.scheduler.requests)}")


def wipe_device(d: SchedulerSim) -> None:
    """vLLM's own prefix cache and the paged KV tensors, not the tier."""
    assert d.scheduler.reset_prefix_cache()
    for kv in d.kv_caches.values():
        kv.zero_()


def assert_served(d: SchedulerSim, tokens: list[int], blocks: int) -> None:
    """A new request for ``tokens`` (plus one of its own) loads exactly
    ``blocks`` full blocks from the tier and computes the rest: its KV is,
    in every layer and position, what computing the whole prompt gives."""
    wipe_device(d)
    b = d.add("B", tokens + [1], max_tokens=2, kv_transfer_params={"host_cache_stats": True})
    computed = 0
    for _ in range(50):
        if b.num_computed_tokens >= len(tokens) + 1:
            break
        computed += d.step().num_scheduled_tokens.get("B", 0)
    else:
        raise TimeoutError("B's prompt was never computed")
    assert computed == len(tokens) + 1 - blocks * BLOCK_SIZE
    for layer in range(2):
        assert torch.equal(d.device_kv("B", layer, len(tokens)), d.expected_kv(tokens, layer))
    run_chunks(d, "B")
    assert d.finished["B"]["host_cache_stats"]["loaded_tokens"] == blocks * BLOCK_SIZE
    assert_clean(d)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    ("prompt_len", "budget", "chunks"),
    [
        (len(PROMPT), 48, [48, 48, 37]),  # chunks on block boundaries, a partial tail
        (len(PROMPT), 40, [40, 40, 40, 13]),  # chunks ending mid-block
        (8 * BLOCK_SIZE, 64, [64, 64]),  # the last chunk fills the last block
    ],
)
def test_a_chunked_prefill_ending_in_its_last_chunk_stores_every_full_block(
    config, prompt_len, budget, chunks
):
    """max_tokens=1: the request finishes in the step that computes its last
    chunk. Every full block of every chunk is stored, the request's stats
    say so, and a later request is served all of them byte-exact."""
    tokens = PROMPT[:prompt_len]
    full = prompt_len // BLOCK_SIZE
    d = SchedulerSim(CONFIGS[config](), max_num_batched_tokens=budget, num_blocks=64)
    d.add("A", tokens, max_tokens=1, kv_transfer_params={"host_cache_stats": True})
    assert run_chunks(d, "A") == chunks
    assert len(d.outputs["A"]) == 1
    assert d.finished["A"]["host_cache_stats"]["saved_blocks"] == full
    st = tier(d).index_stats()
    assert st["stored"] == st["ready"] == full
    assert_clean(d)
    assert_served(d, tokens, full)
    d.close()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(("budget", "chunks"), [(48, [48, 48, 37, 1, 1]), (1024, [133, 1, 1])])
def test_controls_a_longer_generation_and_an_unchunked_prefill(config, budget, chunks):
    """max_tokens=3 chunked (the request outlives its prefill) and the same
    prompt unchunked: the same full blocks are stored and served."""
    d = SchedulerSim(CONFIGS[config](), max_num_batched_tokens=budget, num_blocks=64)
    d.add("A", PROMPT, max_tokens=3)
    assert run_chunks(d, "A") == chunks
    assert len(d.outputs["A"]) == 3
    full = len(PROMPT) // BLOCK_SIZE
    assert tier(d).index_stats()["stored"] == full
    assert_clean(d)
    assert_served(d, PROMPT, full)
    d.close()


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize(
    ("budget", "steps", "computed_blocks"),
    [
        (48, 1, 3),  # aborted after its first chunk
        (40, 2, 5),  # after two chunks, the second ending mid-block
    ],
)
def test_a_chunked_prefill_aborted_mid_prefill_stores_only_what_was_computed(
    config, budget, steps, computed_blocks
):
    """Aborted between chunks: the tier holds exactly the full blocks the
    chunks computed, nothing stays pinned or reserved, and a later request
    loads those blocks byte-exact and computes the rest."""
    d = SchedulerSim(CONFIGS[config](), max_num_batched_tokens=budget, num_blocks=64)
    a = d.add("A", PROMPT, max_tokens=1)
    for _ in range(steps):
        d.step()
    assert a.num_computed_tokens == steps * budget < len(PROMPT)
    d.scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
    run_chunks(d, "A")
    st = tier(d).index_stats()
    assert st["stored"] == st["ready"] == computed_blocks
    assert_clean(d)
    assert_served(d, PROMPT, computed_blocks)
    d.close()


class AbortAfterScheduleSim(SchedulerSim):
    """As vLLM's workers: a request aborted after ``schedule`` is still run
    in that step (the workers learn of the abort from the next step's
    scheduler output), so its KV is written. The harness's model skips a
    request finished since it was scheduled; this one does not, while vLLM
    keeps its blocks (until its saves are confirmed)."""

    def _kv_writes(self, so: Any) -> list[tuple[int, int, float]]:
        finished = {
            r
            for r in so.num_scheduled_tokens
            if (q := self.scheduler.requests.get(r)) is not None and q.is_finished()
        }
        for r in finished:  # seen as running by the harness's model
            self.scheduler.requests[r].status = RequestStatus.RUNNING
        try:
            return super()._kv_writes(so)
        finally:
            for r in finished:
                self.scheduler.requests[r].status = RequestStatus.FINISHED_ABORTED


@pytest.mark.parametrize("config", CONFIGS)
def test_a_chunked_prefill_aborted_in_the_step_of_its_chunk_leaks_nothing(config):
    """Aborted after ``schedule`` planned the saves of its second chunk,
    before the workers ran it: vLLM keeps its blocks until the saves are
    confirmed (``async_save``), the chunk is computed and stored, nothing
    stays reserved or pinned, and a later request is served both chunks'
    blocks byte-exact."""
    d = AbortAfterScheduleSim(CONFIGS[config](), max_num_batched_tokens=48, num_blocks=64)
    d.add("A", PROMPT, max_tokens=1)
    d.step()
    real_schedule = d.scheduler.schedule

    def schedule_then_abort():
        so = real_schedule()
        d.scheduler.finish_requests(["A"], RequestStatus.FINISHED_ABORTED)
        return so

    d.scheduler.schedule = schedule_then_abort
    d.step()
    d.scheduler.schedule = real_schedule
    run_chunks(d, "A")
    assert_clean(d)
    st = tier(d).index_stats()
    assert st["stored"] == st["ready"] == 6
    assert_served(d, PROMPT, 6)
    d.close()


def test_the_simulators_runner_computes_every_chunk_as_vllms_does():
    """The simulator (the benchmarks' too) samples nothing for a partial
    prefill, as vLLM's runner: the chunked ``max_tokens=1`` request runs
    all three chunks and the host tier stores every full block."""
    d = SchedulerSim(host_cache(), max_num_batched_tokens=48, num_blocks=64)
    d.add("A", PROMPT, max_tokens=1)
    try:
        assert run_chunks(d, "A") == [48, 48, 37]
        assert d.connector.index_stats()["stored"] == len(PROMPT) // BLOCK_SIZE
    finally:
        d.close()
