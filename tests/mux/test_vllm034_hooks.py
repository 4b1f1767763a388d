"""vLLM 0.34's new connector hooks, answered for kvmux's children, and what
vLLM decides from the parent connector's name, each checked against vLLM's
own ``MultiConnector`` over the same children and under both names kvmux
loads as (``KvmuxConnector``, and ``MultiConnector`` with
``kv_connector_module_path`` "kvmux").

Driven through vLLM's real ``KVTransferConfig`` (whose ``kv_cache_access()``
asks the connector factory, as vLLM's start-up does), ``VllmConfig``, the
connector factory and ``Request``. NIXL's classes are only asked their
classmethods here (no NIXL agent is started)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux import KvmuxConfigError, KvmuxConnector, _versions
from kvmux.mux.config import parse_mux_config
from kvmux.mux.parent_name import as_multiconnector, parent_name_problems
from tests.support.harness import (
    child,
    kv_cache_config,
    make_request,
    scripted,
    upstream_config,
    vllm_config,
)

SCHED = KVConnectorRole.SCHEDULER
NAMES = ("KvmuxConnector", "MultiConnector")
EXAMPLE = child("ExampleConnector", shared_storage_path="/tmp/kvmux-ex")
NIXL = {"kv_connector": "NixlConnector", "kv_role": "kv_both"}

needs_034 = pytest.mark.skipif(
    not _versions.HAS_KV_CACHE_ACCESS, reason="vLLM before 0.34 has no kv_cache_access"
)


def kvmux_config(children: list[dict[str, Any]], name: str, **top: Any) -> KVTransferConfig:
    """kvmux over ``children`` under ``name`` (module path "kvmux")."""
    fields: dict[str, Any] = {"kv_role": "kv_both", **top}
    extra = {"connectors": children, **fields.pop("extra", {})}
    return KVTransferConfig(
        kv_connector=name,
        kv_connector_module_path="kvmux",
        kv_connector_extra_config=extra,
        **fields,
    )


def upstream(children: list[dict[str, Any]], **top: Any) -> KVTransferConfig:
    """vLLM's own MultiConnector over the same children."""
    base = upstream_config(children)
    return KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role=top.get("kv_role", base.kv_role),
        kv_buffer_device=top.get("kv_buffer_device", base.kv_buffer_device),
        kv_connector_extra_config=base.kv_connector_extra_config,
    )


# ---------------------------------------------------------- kv_cache_access


@needs_034
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "children",
    [
        [child("KvmuxHostCache", capacity_gib=0.01), EXAMPLE],
        [{**NIXL, "kv_buffer_device": "cuda"}, child("KvmuxHostCache", capacity_gib=0.01)],
        [{**NIXL, "kv_buffer_device": "cpu"}],
    ],
    ids=["host+example", "nixl-cuda+host", "nixl-cpu"],
)
def test_kv_cache_access_is_the_union_of_the_children_as_multiconnector_answers(name, children):
    """What vLLM's start-up asks (``KVTransferConfig.kv_cache_access()``,
    through the factory) is each child's flags, or-ed, as MultiConnector
    0.34 answers for the same children: a NIXL child behind kvmux is seen
    (registers the KV cache, exports it over FABRIC) and no longer hidden
    behind the base class's ``IN_PROCESS``."""
    from vllm.config.kv_transfer import KVCacheAccess

    mine = kvmux_config(children, name)
    theirs = upstream(children)
    assert mine.kv_cache_access() == theirs.kv_cache_access()
    assert KvmuxConnector.kv_cache_access(mine) == theirs.kv_cache_access()
    has_cuda_nixl = any(c.get("kv_buffer_device") == "cuda" for c in children)
    assert (
        KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC in mine.kv_cache_access()
    ) == has_cuda_nixl
    assert mine.registers_kv_cache_memory() == has_cuda_nixl


@needs_034
@pytest.mark.parametrize("name", NAMES)
def test_kv_cache_access_describes_the_children_kvmux_builds_not_the_raw_entries(name):
    """Where kvmux knows more: a child entry without ``kv_buffer_device``
    inherits the parent's at run time (kvmux builds it so), and its answer
    is asked of that config. vLLM's MultiConnector asks of the raw entry,
    whose ``kv_buffer_device`` is the platform's default, not the device
    the NIXL child will buffer on (NIXL registers the device KV cache with
    a CUDA buffer device, host staging buffers with ``cpu``)."""
    from vllm.config.kv_transfer import KVCacheAccess

    default = KVTransferConfig().kv_buffer_device
    parent = "cpu" if default != "cpu" else "cuda"

    def nixl(device: str) -> KVCacheAccess:
        if device == "cpu":
            return KVCacheAccess.IN_PROCESS
        return KVCacheAccess.REGISTERS | KVCacheAccess.EXPORTS_FABRIC

    children = [NIXL, child("KvmuxHostCache", capacity_gib=0.01)]
    mine = kvmux_config(children, name, kv_buffer_device=parent)
    assert parse_mux_config(mine).children[0].transfer_config.kv_buffer_device == parent
    assert mine.kv_cache_access() == nixl(parent)
    theirs = upstream(children, kv_buffer_device=parent)
    assert theirs.kv_cache_access() == nixl(default) != nixl(parent)


@needs_034
def test_a_config_kvmux_cannot_run_is_refused_at_construction_not_in_vllms_config():
    """vLLM 0.34 asks ``kv_cache_access`` (and may ask the lookahead
    question) while it builds its ``VllmConfig``: for a config kvmux cannot
    run the answers are neutral, so the refusal is kvmux's own
    ``KvmuxConfigError`` naming every problem at construction, not an error
    wrapped in vLLM's config validation."""
    from vllm.config.kv_transfer import KVCacheAccess

    bad = kvmux_config([{**EXAMPLE, "kv_connector": "NoSuchConnector"}], "KvmuxConnector")
    assert KvmuxConnector.kv_cache_access(bad) == KVCacheAccess.IN_PROCESS
    assert KvmuxConnector.supports_lookahead_block_hashes(bad) is False
    cfg = vllm_config(bad)
    with pytest.raises(KvmuxConfigError, match="NoSuchConnector"):
        KVConnectorFactory.create_connector(cfg, SCHED, kv_cache_config())


# ---------------------------------------------- supports_lookahead_block_hashes


@pytest.mark.skipif(not _versions.HAS_LOOKAHEAD_HASHES, reason="vLLM before 0.34")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    ("children", "expected"),
    [([NIXL], True), ([NIXL, EXAMPLE], False), ([EXAMPLE], False)],
    ids=["nixl", "nixl+example", "example"],
)
def test_lookahead_hashes_only_when_every_child_supports_them(name, children, expected):
    """vLLM hashes blocks with the drafter's lookahead only when the
    connector says so; true only when every child does, as MultiConnector
    0.34 answers."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    mine = kvmux_config(children, name)
    cls = KVConnectorFactory.get_connector_class(mine)
    assert cls is KvmuxConnector
    assert cls.supports_lookahead_block_hashes(mine) is expected
    assert MultiConnector.supports_lookahead_block_hashes(upstream(children)) is expected


# ----------------------------------------------------------- may_load_async


@pytest.mark.skipif(not _versions.HAS_MAY_LOAD_ASYNC, reason="vLLM before 0.34")
@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize(
    "params", [None, {"do_remote_prefill": True}, {"other": 1}], ids=["none", "remote", "other"]
)
def test_may_load_async_answers_as_multiconnector_over_the_same_children(name, params):
    """vLLM 0.34 asks on every enqueue; true when any child may load the
    request asynchronously (here vLLM's P/D default of each child: the
    request's ``do_remote_prefill``)."""
    children = [EXAMPLE, child("ExampleConnector", shared_storage_path="/tmp/kvmux-ex2")]
    mine = KVConnectorFactory.create_connector(
        vllm_config(kvmux_config(children, name)), SCHED, kv_cache_config()
    )
    theirs = KVConnectorFactory.create_connector(
        vllm_config(upstream(children)), SCHED, kv_cache_config()
    )
    req = make_request("r", range(40), kv_transfer_params=params)
    assert mine.may_load_async(req) == theirs.may_load_async(req)
    assert mine.may_load_async(req) is bool(params and params.get("do_remote_prefill"))


@pytest.mark.skipif(not _versions.HAS_MAY_LOAD_ASYNC, reason="vLLM before 0.34")
def test_may_load_async_asks_only_children_that_answer_per_request():
    """It runs on every enqueue: one child that answers per request is
    called directly (no kvmux frame), several are asked in order until one
    says yes, and a child that raises is named."""
    from kvmux import KvmuxChildError

    def build(children):
        return KVConnectorFactory.create_connector(
            vllm_config(kvmux_config(children, "KvmuxConnector")), SCHED, kv_cache_config()
        )

    req = make_request("r", range(40))
    one = build([scripted(load_async=True)])
    assert one.may_load_async.__self__ is one.children[0]
    assert one.may_load_async(req) is True
    two = build([scripted(), scripted(load_async=True)])
    assert two.may_load_async(req) is True
    two.children[1].script["load_async"] = False
    assert two.may_load_async(req) is False
    bad = build([scripted(), scripted(fail="may_load_async")])
    with pytest.raises(KvmuxChildError, match="ScriptedConnector#1.*may_load_async"):
        bad.may_load_async(req)


# ------------------------------------------------- decisions taken by name


def _roles_differ_by_name(ktc: KVTransferConfig) -> bool:
    multi = as_multiconnector(ktc, parse_mux_config(ktc))
    return (ktc.is_kv_producer, ktc.is_kv_consumer) != (
        multi.is_kv_producer,
        multi.is_kv_consumer,
    )


def test_roles_that_vllm_reads_only_under_multiconnector_refuse_to_start_with_the_fix():
    """A prefill whose host tier also loads (``kv_both``) under a top-level
    ``kv_producer``: vLLM 0.34 derives the roles from the children only
    under the name ``MultiConnector`` (it would defer freeing blocks a load
    may fill), so under ``KvmuxConnector`` kvmux refuses to start, naming
    the top-level ``kv_role`` that makes both agree. vLLM 0.33 reads the
    top-level role under any name: nothing differs, kvmux starts."""
    children = [
        {**EXAMPLE, "kv_role": "kv_producer"},
        child("KvmuxHostCache", capacity_gib=0.01),
    ]
    ktc = kvmux_config(children, "KvmuxConnector", kv_role="kv_producer")
    cfg = vllm_config(ktc)
    if not _roles_differ_by_name(ktc):  # vLLM 0.33
        assert parent_name_problems(ktc, parse_mux_config(ktc), cfg) == []
        KVConnectorFactory.create_connector(cfg, SCHED, kv_cache_config())
        return
    with pytest.raises(KvmuxConfigError) as err:
        KVConnectorFactory.create_connector(cfg, SCHED, kv_cache_config())
    msg = str(err.value)
    assert "kv_role 'kv_producer'" in msg and "set the top-level \"kv_role\" to 'kv_both'" in msg
    assert '"MultiConnector"' in msg
    # Either fix starts it, and vLLM then sees the roles the children have.
    fixed = kvmux_config(children, "KvmuxConnector", kv_role="kv_both")
    assert fixed.is_kv_consumer and not _roles_differ_by_name(fixed)
    KVConnectorFactory.create_connector(vllm_config(fixed), SCHED, kv_cache_config())
    renamed = kvmux_config(children, "MultiConnector", kv_role="kv_producer")
    assert renamed.is_kv_consumer
    conn = KVConnectorFactory.create_connector(vllm_config(renamed), SCHED, kv_cache_config())
    assert type(conn) is KvmuxConnector


def test_roles_that_add_up_start_under_either_name():
    """Every child inheriting the parent's role (the README's configs) or
    roles that add up to it: nothing to refuse."""
    for children, role in (
        ([EXAMPLE, child("KvmuxHostCache", capacity_gib=0.01)], "kv_both"),
        ([{**EXAMPLE, "kv_role": "kv_consumer"}], "kv_consumer"),
    ):
        ktc = kvmux_config(children, "KvmuxConnector", kv_role=role)
        assert parent_name_problems(ktc, parse_mux_config(ktc), vllm_config(ktc)) == []


@pytest.mark.skipif(
    not hasattr(KVTransferConfig, "uses_custom_mem_pool"),
    reason="vLLM before 0.34 does not read custom_mem_pool",
)
def test_a_childs_custom_mem_pool_needs_the_key_at_the_top_level():
    """vLLM 0.34 must not use its extensible KV cache when a connector
    allocates the KV cache from its own pool, and looks for the key in the
    children only under ``MultiConnector``: kvmux refuses until the key is
    at its top level (kvmux accepts and passes it on), which vLLM then
    sees."""
    children = [{**EXAMPLE, "kv_connector_extra_config": {"custom_mem_pool": True}}]
    ktc = kvmux_config(children, "KvmuxConnector")
    assert upstream(children).uses_custom_mem_pool() and not ktc.uses_custom_mem_pool()
    with pytest.raises(KvmuxConfigError, match='add "custom_mem_pool": true'):
        KVConnectorFactory.create_connector(vllm_config(ktc), SCHED, kv_cache_config())
    fixed = kvmux_config(children, "KvmuxConnector", extra={"custom_mem_pool": True})
    assert fixed.uses_custom_mem_pool()
    KVConnectorFactory.create_connector(vllm_config(fixed), SCHED, kv_cache_config())
    with pytest.raises(KvmuxConfigError, match="custom_mem_pool='yes' must be true or false"):
        parse_mux_config(kvmux_config(children, "KvmuxConnector", extra={"custom_mem_pool": "yes"}))


def test_children_vllm_looks_for_by_name_refuse_where_its_decision_matters():
    """``has_connector(name)`` finds a child only under ``MultiConnector``.
    ``SimpleCPUOffloadConnector`` needs vLLM to hand it its CPU block count
    (prefix caching on, vLLM's default): refused, naming the other name. A
    NIXL child changes nothing vLLM decides with default settings (no
    routed experts, no decode context parallelism): it starts; with
    ``decode_context_parallel_size`` 2, NIXL's checks would be skipped:
    refused."""
    offload = {
        "kv_connector": "SimpleCPUOffloadConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"num_cpu_blocks": 64},
    }
    ktc = kvmux_config([offload, EXAMPLE], "KvmuxConnector")
    problems = parent_name_problems(ktc, parse_mux_config(ktc), vllm_config(ktc))
    assert len(problems) == 1 and "SimpleCPUOffloadConnector" in problems[0]
    assert "CPU block count" in problems[0] and '"MultiConnector"' in problems[0]
    renamed = kvmux_config([offload, EXAMPLE], "MultiConnector")
    assert parent_name_problems(renamed, parse_mux_config(renamed)) == []
    no_cache = vllm_config(ktc, prefix_caching=False)
    assert parent_name_problems(ktc, parse_mux_config(ktc), no_cache) == []

    nixl = kvmux_config([NIXL, EXAMPLE], "KvmuxConnector")
    cfg = vllm_config(nixl)
    assert parent_name_problems(nixl, parse_mux_config(nixl), cfg) == []
    cfg.parallel_config.decode_context_parallel_size = 2
    (problem,) = parent_name_problems(nixl, parse_mux_config(nixl), cfg)
    assert "NixlConnector" in problem and "decode_context_parallel_size=2" in problem


def test_doctor_names_the_name_dependent_problem_before_start():
    """``python -m kvmux doctor`` reports it with the fix and exits 1 (on a
    vLLM where the decision differs by name), 0 where it does not."""
    children = [
        {**EXAMPLE, "kv_role": "kv_producer"},
        child("KvmuxHostCache", capacity_gib=0.01),
    ]
    raw = {
        "kv_connector": "KvmuxConnector",
        "kv_connector_module_path": "kvmux",
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"connectors": children},
    }
    proc = subprocess.run(
        [sys.executable, "-m", "kvmux", "doctor", json.dumps(raw), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    rep = json.loads(proc.stdout)
    if _roles_differ_by_name(KVTransferConfig(**raw)):
        assert proc.returncode == 1 and not rep["ok"]
        assert any("'kv_both'" in p for p in rep["problems"])
    else:
        assert proc.returncode == 0 and rep["ok"], rep["problems"]
