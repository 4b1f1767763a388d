"""The documentation's configurations, read from README.md and docs/ (``readme_configs.py``):
every block is marked and parses, ``doctor`` accepts each one, and the
blocks with LMCache run here too, through vLLM 0.33's real scheduler and
workers with the real LMCache MP server, as written (only the server's port
and the host tier's capacity swapped), where the loaded KV can be compared
bit for bit. Every block is also started in a real engine (``tests/e2e``).
"""

from __future__ import annotations

import re

import pytest
from vllm.config import KVTransferConfig

from kvmux.cli.doctor import diagnose
from kvmux.mux.config import lmcache_refusal
from tests.mux.test_lmcache import (
    ASK,
    PREFIX,
    child_by_name,
    forget_locally,
    kv_is_exact,
    step_until_computed,
    store_prefix,
)
from tests.support.harness import SchedulerSim
from tests.support.lmcache_server import time_limit
from tests.support.readme_configs import (
    ACROSS_INSTANCES,
    IN_THE_ENGINE,
    ON_THE_SCHEDULER,
    PAGES,
    PD_CONFIGS,
    SUBSTITUTABLE,
    readme_configs,
    substitute,
    unmarked_blocks,
)

README = readme_configs()


def test_every_config_block_is_marked_and_started():
    assert unmarked_blocks() == []
    assert set(README) == set(IN_THE_ENGINE) | set(PD_CONFIGS) | set(ACROSS_INSTANCES)
    with_lmcache = {
        i
        for i, c in README.items()
        if "LMCacheMPConnector" in str(c.config.get("kv_connector_extra_config"))
    }
    assert with_lmcache == set(ON_THE_SCHEDULER)


def test_the_readme_is_a_front_door_that_links_every_page_of_the_manual():
    """The README stays short (what kvmux is, the two commands, install, the
    quick start, a map) and every page of ``docs/`` is reachable from it, as
    every relative link in the README and the pages resolves to a file."""
    text = PAGES[0].read_text()
    # 280: the front door holds the demo, the install line and the serving
    # steps a newcomer runs without docs/ (issue 46), each tested as written.
    assert len(text.splitlines()) <= 280, "the README grew past a front door: move it to docs/"
    for page in PAGES[1:]:
        assert f"(docs/{page.name})" in text, f"the README's map does not link docs/{page.name}"
    for page in PAGES:
        for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", page.read_text()):
            assert (page.parent / target).exists(), f"{page.name} links {target}, which is missing"


def test_both_connector_names_are_shown_and_run():
    names = {c.config["kv_connector"] for c in README.values()}
    assert {"KvmuxConnector", "MultiConnector", "KvmuxHostCache"} <= names


@pytest.mark.parametrize("readme_id", list(README))
def test_doctor_accepts_every_readme_config(readme_id):
    """Where LMCache cannot run on the installed vLLM (lmcache 0.5.6 on vLLM
    0.34), doctor reports that refusal for the blocks with LMCache, and only
    it (``tests/mux/test_lmcache_vllm034.py``)."""
    rep = diagnose(README[readme_id].config)
    refusal = lmcache_refusal() if readme_id in ON_THE_SCHEDULER else None
    if refusal is None:
        assert rep.ok, rep.problems
    else:
        assert len(rep.problems) == 1 and "resumed_req_ids" in rep.problems[0], rep.problems


def test_a_test_may_substitute_resources_but_nothing_else():
    cfg = README["quickstart"].config
    out = substitute(cfg, capacity_gib=0.01, lmcache_mp_port=1234)
    host, lm = out["kv_connector_extra_config"]["connectors"]
    assert host["kv_connector_extra_config"] == {"capacity_gib": 0.01}
    assert lm["kv_connector_extra_config"]["lmcache.mp.port"] == 1234
    assert cfg["kv_connector_extra_config"]["connectors"][0]["kv_connector_extra_config"] == {
        "capacity_gib": 8
    }
    assert "kv_connector" not in SUBSTITUTABLE
    with pytest.raises(ValueError, match="not resources"):
        substitute(cfg, load_policy="longest")


@pytest.mark.parametrize("readme_id", list(ON_THE_SCHEDULER))
def test_the_readme_lmcache_config_stores_and_loads_byte_exact(
    readme_id, lmcache_runs, lmcache_server, model_dir, vllms_load_rule
):
    """With vLLM's own hybrid-manager decision on an HMA platform (on for
    both: ``KvmuxConnector`` supports HMA, and under the ``MultiConnector``
    name so do both children), the README's block stores a prefix seen
    twice through LMCache (save admission, the default: a prefix seen once
    goes to the host tier only) and, once every local copy is wiped, loads
    it back from LMCache bit for bit. (With vLLM's load rule: the
    simulator's stand-in model computes for next to nothing, so the default
    cost rule would rightly decline LMCache's "not ready" wait here;
    tests/e2e/test_readme_configs.py runs the configs as written.)"""
    block = README[readme_id]
    assert block.serve_flags == []  # vLLM's default block size, the suite's (16)
    cfg = substitute(block.config, capacity_gib=0.01, lmcache_mp_port=lmcache_server.port)
    d = SchedulerSim(KVTransferConfig(**cfg), model_dir=model_dir, idle_wait_s=0.02)
    try:
        hma_on = not d.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        assert hma_on is ON_THE_SCHEDULER[readme_id]
        assert d.connector.child_names == ["KvmuxHostCache", "LMCacheMPConnector"]
        # Seen once: the host tier only, unless the block gives the store every
        # save (docs/many-instances.md's shared store: "save_policy": "always").
        store_prefix(d, "A0")
        entry = next(
            c
            for c in cfg["kv_connector_extra_config"]["connectors"]
            if c["kv_connector"] == "LMCacheMPConnector"
        )
        declined = 0 if entry.get("save_policy") == "always" else 1
        assert (
            d.connector.mux_stats()["children"]["LMCacheMPConnector"]["declined_saves"] == declined
        )
        store_prefix(d)
        forget_locally(d)
        b = d.add("B", PREFIX + [9] * 5, kv_transfer_params=ASK)
        step_until_computed(d, b, len(PREFIX))
        assert kv_is_exact(d, "B", PREFIX)
        with time_limit(60):
            d.run(max_steps=3000, timeout_s=45)
        assert d.finished["B"]["num_extra_cached_tokens"] == 48
        assert d.finished["B"]["cached_token_stats"]["num_lmcache_extra_cached_tokens"] == 48
        assert child_by_name(d, "KvmuxHostCache") is d.connector.children[0]
        assert d.connector.num_live_requests() == 0
    finally:
        d.close()
