"""KV cache events from every tier in a real vLLM engine, as a KV-aware router
receives them: vLLM's own ZMQ publisher (``kv_events_config``) on a local
port and a subscriber decoding its ``KVEventBatch`` messages.

kvmux runs the host tier (room for 6 blocks) and a child that reports its
stores from its workers (``tests.support.event_children``); two prompts of 5 full
blocks each, then the first again after vLLM's own prefix cache is reset.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvmux.cli import engine
from tests.e2e.engine_runs import close_llm, reset_prefix_cache

BLOCK_SIZE = engine.CPU_BLOCK_SIZE
FIRST = [100 + t for t in range(5 * BLOCK_SIZE + 3)]
SECOND = [600 + t for t in range(5 * BLOCK_SIZE + 3)]
WORKER_CHILD = {
    "kv_connector": "WorkerEventsConnector",
    "kv_connector_module_path": "tests.support.event_children",
    "kv_role": "kv_both",
}


@dataclass
class Received:
    events: list[Any] = field(default_factory=list)

    def of(self, kind: Any, medium: str, ownership: Any = ...) -> list[Any]:
        return [
            e
            for e in self.events
            if isinstance(e, kind)
            and e.medium == medium
            and (ownership is ... or e.ownership == ownership)
        ]


def _drain(sub: Any, decode: Any, quiet_s: float = 1.0) -> list[Any]:
    out = []
    while sub.poll(int(quiet_s * 1000)):
        _topic, _seq, payload = sub.recv_multipart()
        out.extend(decode(payload).events)
    return out


@pytest.fixture(scope="module")
def received(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Received:
    import msgspec
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig, KVTransferConfig
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.inputs import TokensPrompt

    engine.prepare_env(multiprocess=False)
    # vLLM's publisher binds a local (ipc) endpoint; the subscriber connects.
    endpoint = f"ipc://{tmp_path_factory.mktemp('kv-events')}/events"
    ktc = engine.host_tier_config(WORKER_CHILD)
    ktc["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"] = {
        "num_blocks": 6
    }
    llm = LLM(
        model=model_dir,
        dtype="float32",
        max_model_len=engine.MAX_MODEL_LEN,
        enforce_eager=True,
        block_size=BLOCK_SIZE,
        enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**ktc),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        ),
        seed=0,
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    try:
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(endpoint)
        time.sleep(0.5)  # the subscription reaches the publisher
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        for prompt in (FIRST, SECOND):  # one at a time: the second evicts
            llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
        assert reset_prefix_cache(llm)
        llm.generate([TokensPrompt(prompt_token_ids=FIRST)], params, use_tqdm=False)
        return Received(_drain(sub, msgspec.msgpack.Decoder(type=KVEventBatch).decode))
    finally:
        sub.close(linger=0)
        close_llm(llm)


def test_the_host_tier_publishes_its_blocks_with_the_cpu_medium_and_gpu_hashes(received):
    from vllm.distributed.kv_events import BlockStored

    gpu = {h for e in received.of(BlockStored, "GPU", None) for h in e.block_hashes}
    cpu = received.of(BlockStored, "CPU", "KvmuxHostCache")
    assert cpu and all(e.locality == "LOCAL" and e.block_size == BLOCK_SIZE for e in cpu)
    # Every block the tier stored is one vLLM's GPU events announced, by the
    # same hash: a router can tell which tier holds each.
    stored = {h for e in cpu for h in e.block_hashes}
    assert stored <= gpu and len(stored) == 10  # both prompts' 5 full blocks


def test_a_router_following_the_events_knows_what_the_host_tier_holds(received):
    """Replaying the tier's stores and removals in order, as a router does:
    a removal always undoes an earlier store, and the tier never holds more
    than its 6 blocks. The first prompt's blocks, evicted by the second's,
    were stored again when it came back."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    held: set[Any] = set()
    removed = 0
    for e in received.of((BlockStored, BlockRemoved), "CPU", "KvmuxHostCache"):
        for h in e.block_hashes:
            if isinstance(e, BlockStored):
                assert h not in held
                held.add(h)
            else:
                assert h in held
                held.remove(h)
                removed += 1
        assert len(held) <= 6
    assert removed >= 4 and len(held) == 6


def test_a_childs_worker_events_are_published_labelled_with_it(received):
    from vllm.distributed.kv_events import BlockStored

    gpu = {h for e in received.of(BlockStored, "GPU", None) for h in e.block_hashes}
    theirs = received.of(BlockStored, "STORAGE", "WorkerEventsConnector")
    assert theirs and {h for e in theirs for h in e.block_hashes} <= gpu
    # Only vLLM's own events (and its reset's AllBlocksCleared) are unlabelled.
    unlabelled = {
        getattr(e, "medium", None) for e in received.events if getattr(e, "ownership", None) is None
    }
    assert unlabelled <= {"GPU", None}
