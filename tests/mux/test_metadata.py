"""``KvmuxMetadata``, what the scheduler's ``build_connector_meta`` hands the
workers each step: an object the Rust bindings build (no Python frame of
kvmux's on vLLM's call), which vLLM's code sees as a ``KVConnectorMetadata``
and which crosses to the worker processes pickled, by value."""

from __future__ import annotations

import pickle

import pytest
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.core.sched.output import SchedulerOutput

from kvmux.mux.metadata import KvmuxMetadata
from tests.support.harness import NOOP, child, kv_cache_config, mux_config, scripted, vllm_config


def _connectors():
    cfg = vllm_config(mux_config([scripted(), child("NoopConnector", module=NOOP)]))
    return tuple(
        KVConnectorFactory.create_connector(cfg, role, kv_cache_config())
        for role in (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
    )


def test_the_scheduler_hands_a_kvconnectormetadata_the_worker_binds_after_pickling():
    sched, worker = _connectors()
    meta = sched.build_connector_meta(SchedulerOutput.make_empty())
    assert type(meta) is KvmuxMetadata
    assert isinstance(meta, KVConnectorMetadata)
    assert len(meta.children) == 2
    assert all(isinstance(m, KVConnectorMetadata) for m in meta.children)
    # The usual step: nothing for the workers to wait for, no dict built.
    assert (meta.saves, meta.loads, meta.load_blocks) == (None, None, None)
    got = pickle.loads(pickle.dumps(meta))
    assert type(got) is KvmuxMetadata and len(got.children) == 2
    worker.bind_connector_metadata(got)
    assert worker.has_connector_metadata()


def test_it_pickles_by_value_and_says_what_it_holds():
    saves = {"req-1": (0b11, 2)}
    loads = {"req-2": 0b01}
    blocks = {"req-2": [4, 5]}
    meta = KvmuxMetadata((KVConnectorMetadata(),), saves, loads=loads, load_blocks=blocks)
    got = pickle.loads(pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL))
    assert (got.saves, got.loads, got.load_blocks) == (saves, loads, blocks)
    assert got.saves is not saves
    assert "saves={'req-1': (3, 2)}" in repr(got)
    # Built from any sequence of child metadata, kept as a tuple; read-only.
    listed = KvmuxMetadata(children=[KVConnectorMetadata()])
    assert isinstance(listed.children, tuple) and listed.saves is None
    with pytest.raises(AttributeError):
        listed.saves = saves  # type: ignore[misc]


def test_a_worker_refuses_metadata_of_another_configuration():
    _, worker = _connectors()
    with pytest.raises(TypeError, match="same KvmuxConnector configuration"):
        worker.bind_connector_metadata(KvmuxMetadata(children=(KVConnectorMetadata(),)))
    with pytest.raises(TypeError, match="same KvmuxConnector configuration"):
        worker.bind_connector_metadata(KVConnectorMetadata())
