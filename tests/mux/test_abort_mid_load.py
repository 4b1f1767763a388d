"""A client aborts a request while vLLM waits for its remote KV, beside a
child that saves it asynchronously (issue 23, item 2).

Through vLLM 0.33's real v1 ``Scheduler`` and kvmux's real worker side
(``tests/support/harness.py``, workers stepped as vLLM 0.33's model runner steps
them, ``get_transfer_results``). Child 0 stands in for a NIXL decode (it
loads asynchronously and its workers report the load finished receiving when
the test releases it, ``hold_loads``), child 1 for a tier that saves
asynchronously (its save completes when the test releases it, ``hold``);
both are ``tests/support/scripted.py`` children, as a remote peer cannot run here.

What vLLM 0.33 does (``Scheduler.finish_requests``, ``_free_request``,
``_update_from_kv_xfer_finished``): a request aborted in
``WAITING_FOR_REMOTE_KVS`` keeps its blocks until its load is reported
(unless the report already came), and also while the connector says it
saves asynchronously; then the *first* ``finished_recving`` or
``finished_sending`` of it frees the request, and the second one hits
``assert req_id in self.requests`` and takes the engine core down. kvmux
holds every completion of such a request but the last
(``rust/mux/scheduler/held.rs``, ``SchedulerMux::reported``): vLLM hears of it once, after the load
and the save both ended, and frees its blocks then. vLLM's own
``MultiConnector`` passes both and crashes.
"""

from __future__ import annotations

from typing import Any

import pytest
from vllm.v1.request import RequestStatus

from tests.mux.test_compose_async import Sim
from tests.support.harness import mux_config, scripted, upstream_config

# A later child must save what it sees once (vLLM's rule): see conftest.
pytestmark = pytest.mark.usefixtures("every_child_saves")

PROMPT = list(range(500, 560))  # 60 tokens, 48 of them loadable
LOADER, SAVER = 0, 1


def children() -> list[dict[str, Any]]:
    return [
        scripted(matched=48, load_async=True, hold_loads=["r"]),
        scripted(async_save=True, hold=["r"]),
    ]


def release(worker_children: Any, which: int) -> None:
    """The loader's workers report its load of "r", or the saver's its save."""
    key = "hold_loads" if which == LOADER else "hold"
    worker_children[which].script[key] = []


def abort_while_waiting(d: Sim) -> Any:
    r = d.add("r", PROMPT)
    d.step()
    d.step()
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    d.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    d.step()  # the saver hears of its save with this step's metadata
    return r


def free_blocks(d: Sim) -> int:
    return d.scheduler.kv_cache_manager.block_pool.get_num_free_blocks()


@pytest.mark.parametrize(
    "order",
    [(LOADER, SAVER), (SAVER, LOADER), None],
    ids=["load-ends-first", "save-ends-first", "same-step"],
)
def test_an_abort_mid_load_beside_a_saver_is_reported_once(order):
    """vLLM hears of the aborted request once, after its load and its save
    both ended; its blocks stay allocated until then; the engine serves the
    next request, and nothing is left in kvmux or vLLM."""
    d = Sim(mux_config(children()))
    idle = free_blocks(d)
    abort_while_waiting(d)
    kids = d.worker.children
    if order is None:
        release(kids, LOADER)
        release(kids, SAVER)
    else:
        release(kids, order[0])
        for _ in range(3):
            d.step()
        assert "r" in d.scheduler.requests, "freed before both children ended"
        assert free_blocks(d) < idle, "its blocks were given back under a running transfer"
        assert d.seen("finished_recving") + d.seen("finished_sending") == {}
        release(kids, order[1])
    for _ in range(3):
        d.step()
    told = d.seen("finished_recving") + d.seen("finished_sending")
    assert told == {"r": 1}, f"vLLM heard of the aborted request {told} times"
    assert "r" not in d.scheduler.requests
    assert free_blocks(d) == idle
    assert d.connector._scheduler.mux.joined_requests() == 0
    # The engine goes on: the next request loads and runs.
    kids[LOADER].script["hold_loads"] = []
    d.add("s", PROMPT)
    d.run()
    assert len(d.outputs["s"]) > 0
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_loads() == 0
    assert not d.scheduler.requests


def test_vllm_multiconnector_crashes_on_the_same_abort():
    """The difference from vLLM's ``MultiConnector``, over the same children
    and the same sequence: it hands vLLM both completions, and the second
    fails vLLM's ``assert req_id in self.requests`` (an engine crash)."""
    d = Sim(upstream_config(children()))
    abort_while_waiting(d)
    kids = d.workers[0]._connectors
    release(kids, SAVER)
    d.step()
    assert "r" not in d.scheduler.requests, "freed on the save, the load still running"
    release(kids, LOADER)
    with pytest.raises(AssertionError):
        for _ in range(3):
            d.step()


def test_a_load_reported_before_the_abort_leaves_only_the_save():
    """The load was reported (vLLM has it in ``finished_recving_kv_req_ids``)
    and the request is aborted before it runs: vLLM then waits for the save
    alone, and kvmux passes it at once."""
    d = Sim(mux_config(children()))
    r = d.add("r", PROMPT)
    d.step()
    release(d.worker.children, LOADER)
    d.step()  # the load is reported; r is still waiting for remote KV
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert d.seen("finished_recving") == {"r": 1}
    d.scheduler.finish_requests("r", RequestStatus.FINISHED_ABORTED)
    release(d.worker.children, SAVER)
    d.step()
    d.step()
    assert d.seen("finished_sending") == {"r": 1}
    assert not d.scheduler.requests
    assert d.connector._scheduler.mux.joined_requests() == 0


def test_an_abort_mid_load_without_a_saver_passes_the_load():
    """Nobody saves: vLLM frees the aborted request on its load's report,
    which kvmux passes as before."""
    d = Sim(mux_config([scripted(matched=48, load_async=True, hold_loads=["r"]), scripted()]))
    abort_while_waiting(d)
    assert "r" in d.scheduler.requests
    release(d.worker.children, LOADER)
    d.step()
    assert d.seen("finished_recving") == {"r": 1}
    assert not d.scheduler.requests
