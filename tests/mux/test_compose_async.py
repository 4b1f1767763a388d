"""Two asynchronous loaders of one request under ``load_policy: "compose"``
(issue 15): loads from several children must all finish before the request
runs, and a failed span makes vLLM recompute from its first missing block,
never run over a hole.

Through vLLM's real v1 ``Scheduler`` and kvmux's real worker side
(``tests/support/harness.py``), with the worker step vLLM 0.33's model runner runs
(``get_transfer_results``, failed receives included, then the load errors).
The two loaders are ``tests/support/scripted.py`` children declared ``loads_spans``:
the first holds ``[0, 32)``, the second ``[0, 48)`` and is asked after the
first's hit, so it loads ``[32, 48)``. Each reports its load finished in the
step that starts it unless the test holds it (``hold_loads``), so the two
completions arrive in the steps and the order a test chooses. The rules
under test: ``rust/mux/scheduler/admission.rs`` (``allocated``: the bit set of async loaders)
and ``rust/mux/completions.rs`` (a receive is done when each loader reported;
failed, in vLLM's ``finished_recving`` and ``failed_recving`` both, when one
of them reported its load failed). The failed-receive tests found that
kvmux's worker once used up the failing child's completion on its
``finished_recving`` and dropped the same id in ``failed_recving`` as a
stray: vLLM ran the request over the span that never arrived.
"""

from __future__ import annotations

import pickle
from collections import Counter
from typing import Any

import pytest
from vllm.forward_context import ForwardContext
from vllm.v1.outputs import KVConnectorOutput
from vllm.v1.request import RequestStatus

from kvmux import KvmuxConnector
from tests.support import harness
from tests.support.harness import mux_config, scripted
from tests.support.sim import fake_model_output

PROMPT = list(range(500, 560))  # 60 tokens: 3 full blocks loadable, the rest computed
SPANS = (32, 16)  # child 0 loads [0, 32), child 1 [32, 48)
WANT = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True}
NAMES = ("ScriptedConnector#0", "ScriptedConnector#1")


class Sim(harness.SchedulerSim):
    """The harness's scheduler, its workers stepped as vLLM 0.33's model
    runner does (``get_transfer_results``, so ``failed_recving`` reaches the
    scheduler), and every step's merged ``KVConnectorOutput`` kept."""

    def __init__(self, ktc: Any) -> None:
        super().__init__(ktc)
        self.kv_outputs: list[KVConnectorOutput] = []
        update = self.scheduler.update_from_output

        def record(so: Any, out: Any) -> Any:
            self.kv_outputs.append(out.kv_connector_output or KVConnectorOutput())
            return update(so, out)

        self.scheduler.update_from_output = record

    def _run_worker(self, w: Any, kv_caches: Any, so: Any, writes: Any) -> Any:
        w.bind_connector_metadata(pickle.loads(pickle.dumps(so.kv_connector_metadata)))
        w.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        for layer, (name, kv) in enumerate(kv_caches.items()):
            w.wait_for_layer_load(name)
            for block, offset, value in writes:
                kv[block, :, offset, :] = value + layer
            w.save_kv_layer(name, kv, None)
        w.wait_for_save()
        res = w.get_transfer_results(set(so.finished_req_ids))
        out = KVConnectorOutput(
            finished_sending=res.finished_sending,
            finished_recving=res.finished_recving,
            failed_recving=res.failed_recving,
            invalid_block_ids=w.get_block_ids_with_load_errors(),
            kv_connector_worker_meta=w.build_connector_worker_meta(),
            kv_connector_stats=w.get_kv_connector_stats(),
        )
        w.clear_connector_metadata()
        return pickle.loads(pickle.dumps(fake_model_output(so, kv_out=out)))

    def seen(self, field: str) -> Counter:
        """How often vLLM was handed each request id in ``field``."""
        return Counter(r for o in self.kv_outputs for r in (getattr(o, field) or ()))


def loader(matched: int, **script: Any) -> dict[str, Any]:
    return {**scripted(matched=matched, load_async=True, **script), "loads_spans": True}


def two_loaders(first: dict | None = None, second: dict | None = None) -> Sim:
    """Both loaders hold the load of "r" until the test releases it."""
    ktc = mux_config(
        [
            loader(32, hold_loads=["r"], **(first or {})),
            loader(48, hold_loads=["r"], **(second or {})),
        ],
        load_policy="compose",
    )
    ktc.kv_load_failure_policy = "recompute"
    return Sim(ktc)


def release(d: Sim, i: int) -> None:
    """Child i's workers report its load of "r" in the next step."""
    d.worker.children[i].script["hold_loads"] = []


def forget_prefix(d: Sim) -> None:
    """Neither tier holds the prefix any more (a retry after a failed load
    that freed the request's blocks is a fresh lookup: it computes)."""
    for c in d.connector.children:
        c.script["matched"] = 0


def step_waiting(d: Sim, r: Any, steps: int) -> None:
    """``steps`` steps in which "r" waits for its KV and is never scheduled."""
    for _ in range(steps):
        so = d.step()
        assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
        assert "r" not in so.num_scheduled_tokens, "ran before every loader reported"


def first_run(d: Sim, r: Any, max_steps: int = 5) -> tuple[int, int]:
    """Step until "r" is scheduled: (its tokens computed before that step,
    the tokens that step computes)."""
    for _ in range(max_steps):
        before = r.num_computed_tokens
        so = d.step()
        if "r" in so.num_scheduled_tokens:
            return before, so.num_scheduled_tokens["r"]
    raise AssertionError(f"r not scheduled in {max_steps} steps (status {r.status})")


def counters(d: Sim, name: str) -> dict[str, int]:
    """The workers' counters of one child, as the front end accumulates them."""
    acc = KvmuxConnector.build_kv_connector_stats(None)
    for payload in d.kv_stats:
        acc = acc.aggregate(KvmuxConnector.build_kv_connector_stats(payload))
    return acc.counters.get("children", {}).get(name, {})


def assert_drained(d: Sim) -> None:
    d.run()
    assert d.connector.num_live_requests() == 0
    assert d.worker.num_pending_async_loads() == 0
    assert not d.scheduler.requests


@pytest.mark.parametrize("order", [(0, 1), (1, 0)], ids=["first-span-first", "second-span-first"])
def test_the_request_runs_only_after_both_loaders_reported(order):
    """Each child is told its own span; while one loader has reported, the
    request stays waiting for remote KV, step after step; it runs after the
    second reports (in either order), from the 48 loaded tokens, and vLLM
    hears it finished receiving once; nothing stays pending in kvmux."""
    d = two_loaders()
    r = d.add("r", PROMPT, kv_transfer_params=WANT)
    step_waiting(d, r, 3)
    for i, span in enumerate(SPANS):
        assert d.connector.children[i].calls.count(("alloc", ("r", span))) == 1, (
            f"child {i} was not told its own span of {span} tokens"
        )
    assert d.connector.children[1]._asked_from["r"] == 32, "asked after child 0's hit"
    assert r.num_computed_tokens == 48
    assert d.worker.num_pending_async_loads() == 1

    early, late = order
    release(d, early)
    step_waiting(d, r, 3)  # one loader reported: still waiting, across steps
    assert d.seen("finished_recving") == {}, "vLLM told before the second loader reported"
    assert d.worker.num_pending_async_loads() == 1

    release(d, late)
    d.step()  # the second loader reports: vLLM hears of it now
    assert d.seen("finished_recving") == {"r": 1}
    assert d.worker.num_pending_async_loads() == 0
    assert first_run(d, r) == (48, len(PROMPT) - 48), "runs after the loaded 48 tokens"
    assert_drained(d)
    assert d.seen("finished_recving") == {"r": 1}, "finished receiving exactly once"
    assert not d.seen("failed_recving") and not any(o.invalid_block_ids for o in d.kv_outputs)
    assert d.finished["r"]["cached_tokens_by_child"] == {
        NAMES[0]: 32,
        NAMES[1]: 16,
        "local_prefix_cache": 0,
    }
    assert d.finished["r"]["num_extra_cached_tokens"] == 48
    for name in NAMES:
        assert counters(d, name).get("load_completions") == 1
        assert counters(d, name).get("stray_completions", 0) == 0


def test_a_duplicate_completion_of_one_loader_does_not_stand_for_the_other():
    """Child 0 reports its load, then again in the next step (a duplicate):
    the request still waits for child 1, and the duplicate is dropped."""
    d = two_loaders(first={"repeat_completions": True})
    r = d.add("r", PROMPT, kv_transfer_params=WANT)
    step_waiting(d, r, 1)
    release(d, 0)
    step_waiting(d, r, 4)  # its report, its duplicate, then nothing
    assert d.seen("finished_recving") == {}
    assert d.worker.num_pending_async_loads() == 1
    release(d, 1)
    d.step()
    assert d.seen("finished_recving") == {"r": 1}
    assert first_run(d, r) == (48, len(PROMPT) - 48)
    assert_drained(d)
    assert d.seen("finished_recving") == {"r": 1}
    c0 = counters(d, NAMES[0])
    assert c0["load_completions"] == 1 and c0["stray_completions"] == 1
    assert counters(d, NAMES[1])["load_completions"] == 1


@pytest.mark.parametrize("failing", [0, 1], ids=["first-span-fails", "second-span-fails"])
def test_a_failed_span_is_recomputed_from_its_first_block(failing):
    """One loader's blocks fail (reported as load errors in the step its load
    starts, while the other loader is still loading): the request waits for
    both, then computes from the start of the failed span. A failure in the
    first span discards the second too (it would follow a hole). Only the
    spans before the failure are credited."""
    d = two_loaders(**{("first", "second")[failing]: {"fail_loads": True}})
    r = d.add("r", PROMPT, kv_transfer_params=WANT)
    start = sum(SPANS[:failing])  # the failed span's first token
    d.step()
    assert d.seen("finished_recving") == {}
    assert r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert r.num_computed_tokens == start, "vLLM cut the prefix at the failed span"
    forget_prefix(d)
    release(d, failing)
    step_waiting(d, r, 2)  # the failed loader reported; the other still loads
    assert d.worker.num_pending_async_loads() == 1
    release(d, 1 - failing)
    d.step()
    assert d.seen("finished_recving") == {"r": 1}
    assert first_run(d, r) == (start, len(PROMPT) - start), "computed from the failed block"
    assert_drained(d)
    assert d.seen("finished_recving") == {"r": 1}
    credited = {NAMES[i]: SPANS[i] if i < failing else 0 for i in range(2)}
    assert d.finished["r"]["cached_tokens_by_child"] == {**credited, "local_prefix_cache": 0}
    assert d.finished["r"]["num_extra_cached_tokens"] == start


@pytest.mark.parametrize("failing", [0, 1], ids=["first-span-fails", "second-span-fails"])
def test_a_failed_receive_reaches_vllm_and_the_request_is_recomputed(failing):
    """One loader reports its receive failed (``failed_recving``, and in
    ``finished_recving`` too, as vLLM's contract says): vLLM must hear of the
    failure, so it recomputes the request from its first token (vLLM does so
    for any failed receive); nothing is credited."""
    d = two_loaders(**{("first", "second")[failing]: {"fail_recving": True}})
    r = d.add("r", PROMPT, kv_transfer_params=WANT)
    d.step()
    forget_prefix(d)
    release(d, failing)
    step_waiting(d, r, 2)
    assert d.worker.num_pending_async_loads() == 1
    release(d, 1 - failing)
    d.step()
    assert d.seen("finished_recving") == {"r": 1}
    assert d.seen("failed_recving") == {"r": 1}, "vLLM was not told the receive failed"
    assert first_run(d, r) == (0, len(PROMPT)), "ran over a span that never arrived"
    assert_drained(d)
    assert d.finished["r"]["num_extra_cached_tokens"] == 0
