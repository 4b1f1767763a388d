"""kvmux driven by vLLM's real v1 ``Scheduler`` from arrival to finish, the
scheduler-to-worker metadata pickled on its way (see ``conftest.Driver``)."""

from __future__ import annotations

import pytest

from tests.support.harness import NOOP, child, mux_config, scripted, upstream_config

# A later child must save what it sees once (vLLM's rule): see conftest.
pytestmark = pytest.mark.usefixtures("every_child_saves")

PROMPT = list(range(100, 164))  # 64 tokens: 4 full blocks


def test_requests_flow_from_arrival_to_finish_with_merged_params(driver_factory, tmp_path):
    d = driver_factory(
        mux_config(
            [
                child("ExampleConnector", shared_storage_path=str(tmp_path)),
                scripted(params={"remote_block_ids": [1, 2]}),
                scripted(params={"cache": "hit"}),
            ]
        )
    )
    for i in range(3):
        d.add(f"r{i}", PROMPT[i:] + [i], kv_transfer_params={"num_extra_cached_tokens": None})
    d.run()
    assert set(d.finished) == {"r0", "r1", "r2"}
    for params in d.finished.values():
        assert params == {"remote_block_ids": [1, 2], "cache": "hit", "num_extra_cached_tokens": 0}
    assert all(len(toks) == 4 for toks in d.outputs.values())
    assert d.connector.num_live_requests() == 0
    stats = d.connector.mux_stats()
    assert stats["finished"] == 3
    assert stats["children"]["ScriptedConnector#1"]["lookups"] >= 3


def test_external_hit_is_loaded_by_the_chosen_child_and_reported(driver_factory):
    d = driver_factory(mux_config([scripted(), scripted(matched=48)]))
    d.add("r", PROMPT, kv_transfer_params={"num_extra_cached_tokens": True})
    so = d.step()
    assert so.num_scheduled_tokens["r"] == len(PROMPT) - 48
    allocs = [[c for c in ch.calls if c[0] == "alloc"] for ch in d.connector.children]
    assert allocs[0][0] == ("alloc", ("r", 0)) and allocs[1][0] == ("alloc", ("r", 48))
    d.run()
    assert d.finished["r"] == {"num_extra_cached_tokens": 48}


def test_request_is_finished_sending_only_after_every_async_save(driver_factory):
    """Two children save asynchronously: the scheduler keeps the request's
    blocks until both have reported, and learns of it exactly once."""
    d = driver_factory(
        mux_config([scripted(async_save=True, hold=["r"]), scripted(async_save=True)])
    )
    d.add("r", PROMPT)
    for _ in range(8):
        d.step()
    assert "r" in d.finished  # generation is done ...
    assert "r" in d.scheduler.requests  # ... but the blocks are still held
    assert d.finished_sending == []
    d.worker.children[0].script["hold"] = []
    d.step()
    assert d.finished_sending == ["r"]
    d.run()
    assert "r" not in d.scheduler.requests
    assert d.worker.num_pending_async_saves() == 0
    assert d.finished_sending == ["r"]


def test_per_request_state_is_gone_after_many_lifecycles(driver_factory):
    d = driver_factory(
        mux_config(
            [
                scripted(matched=32, async_save=True),
                scripted(async_save=True, params={"x": 1}),
                child("NoopConnector", module=NOOP),
            ]
        ),
        max_num_seqs=32,
    )
    n = 300
    for i in range(n):
        d.add(
            f"q{i}",
            [i % 7] * 16 + list(range(i, i + 33)),
            kv_transfer_params={"num_extra_cached_tokens": 1},
        )
        if i % 10 == 9:
            d.step()
    d.run(max_steps=2000)
    assert len(d.finished) == n
    assert sorted(d.finished_sending) == sorted(d.finished)
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_saves() == 0
    assert d.connector.mux_stats()["finished"] == n


def test_an_aborted_waiting_request_leaves_no_state(driver_factory):
    from vllm.v1.request import RequestStatus

    d = driver_factory(mux_config([scripted(not_ready=100), scripted()]))
    d.add("slow", PROMPT, kv_transfer_params={"num_extra_cached_tokens": 1})
    d.step()
    d.step()
    assert d.connector.num_live_requests() == 1  # looked up, not ready yet
    d.scheduler.finish_requests(["slow"], RequestStatus.FINISHED_ABORTED)
    assert d.connector.num_live_requests() == 0
    d.run()


@pytest.mark.parametrize("seed", [0, 1])
def test_same_results_as_vllms_multiconnector_on_the_same_children(driver_factory, seed):
    """Where kvmux promises upstream behaviour (load_policy 'first', disjoint
    params, async saves), vLLM's MultiConnector and kvmux give the same
    outputs, params, completions and child calls."""
    children = [
        scripted(matched=32 if seed else 0, params={"a": seed}),
        scripted(matched=48, async_save=True, params={"b": 2}),
        scripted(async_save=True),
    ]
    runs = []
    for ktc in (upstream_config(children), mux_config(children)):
        d = driver_factory(ktc)
        for i in range(6):
            d.add(f"r{i}", PROMPT[: 40 + 4 * i])
        d.run()
        kids = d.connector.sub_connectors  # vLLM's MultiConnector and kvmux alike
        runs.append(
            (
                d.finished,
                d.outputs,
                sorted(d.finished_sending),
                [[c for c in k.calls if c[0] != "get_finished"] for k in kids],
            )
        )
    assert runs[0] == runs[1]
