"""P2: the worker's per-layer hot path, ``wait_for_layer_load`` and
``save_kv_layer`` for every layer of a 32-layer model, through 3 children of
which one does work (:class:`~tests.support.children.LayerworkConnector`, between
two :class:`~tests.support.children.NoopConnector`).

Both worker-side connectors come from vLLM's connector factory, get real CPU
tensors in ``register_kv_caches`` and the connector metadata their
scheduler-side twin built for a real ``SchedulerOutput`` (as vLLM binds it
before a forward: the per-layer hooks run only when metadata is bound). The
timed operation is what vLLM's ``maybe_transfer_kv_layer`` does around each
attention layer: look the hook up on the connector and call it.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from benches.overhead.case import Case
from tests.support.sim import SchedulerSim, kv_cache_config

__all__ = ["build"]

NUM_LAYERS = 32
NOOP = {
    "kv_connector": "NoopConnector",
    "kv_connector_module_path": "tests.support.children",
    "kv_role": "kv_both",
}
WORK = {**NOOP, "kv_connector": "LayerworkConnector"}


def _worker(name: str, module: str | None) -> tuple[Any, Any]:
    ktc = KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path=module,
        kv_role="kv_both",
        kv_connector_extra_config={"connectors": [dict(NOOP), dict(WORK), dict(NOOP)]},
    )
    sim = SchedulerSim(ktc)
    meta = sim.scheduler.schedule().kv_connector_metadata  # a real step's metadata
    # Any: kvmux's connector or vLLM's MultiConnector, each with sub_connectors.
    conn: Any = KVConnectorFactory.create_connector(
        config=sim.vllm_config, role=KVConnectorRole.WORKER, kv_cache_config=kv_cache_config()
    )
    conn.register_kv_caches({n: torch.zeros(4, 2, 16, 64) for n in layer_names()})
    conn.bind_connector_metadata(pickle.loads(pickle.dumps(meta)))
    if not conn.has_connector_metadata():
        raise RuntimeError(f"{name}: no connector metadata bound")
    return conn, conn.sub_connectors[1]


def layer_names() -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


def _forward(conn: Any) -> Any:
    names = layer_names()
    kv = torch.zeros(4, 2, 16, 64)
    attn_metadata = object()

    def forward() -> None:
        for name in names:
            conn.wait_for_layer_load(name)
            conn.save_kv_layer(name, kv, attn_metadata)

    return forward


def build(quick: bool) -> Case:
    kv_conn, kv_work = _worker("KvmuxConnector", "kvmux")
    mc_conn, mc_work = _worker("MultiConnector", None)
    if not type(mc_conn).__module__.startswith("vllm."):
        raise RuntimeError(f"the rival is {type(mc_conn)}, not vLLM's MultiConnector")
    kv_fwd, mc_fwd = _forward(kv_conn), _forward(mc_conn)

    def check() -> None:
        for fwd, work in ((kv_fwd, kv_work), (mc_fwd, mc_work)):
            before = work.layers_waited
            fwd()
            if work.layers_waited - before != NUM_LAYERS or work.last_saved is None:
                raise RuntimeError("the working child did not see every layer")

    return Case(
        key="P2",
        title="worker per-layer hooks, 32 layers, 3 children (1 works)",
        kvmux=kv_fwd,
        rival=mc_fwd,
        rival_name="vLLM MultiConnector",
        unit="forward of 32 layers",
        target=0.2,
        inner=200 if quick else 1000,
        check=check,
        notes={"layers": NUM_LAYERS, "children": ["Noop", "Layerwork", "Noop"]},
    )
