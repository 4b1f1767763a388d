"""LMCache on vLLM 0.34: the README's quick start never fails mid-serving.

lmcache 0.5.6 (the newest on PyPI) cannot run on vLLM 0.34 either way:

- its own ``LMCacheMPConnector`` (vLLM's factory prefers it when lmcache is
  installed) reads ``scheduler_output.scheduled_cached_reqs.resumed_req_ids``
  in ``build_connector_meta`` once a request runs a second step; vLLM 0.34
  removed the field, so the engine dies at the first decode step;
- vLLM 0.34's built-in copy (``LMCACHE_USE_UPSTREAM_MP=1``) builds lmcache's
  scheduler adapter with ``server_url=``, which lmcache 0.5.6 renamed
  ``server_urls``: a TypeError at start-up.

So kvmux refuses such a child at start-up, naming the versions and the fix,
and ``doctor`` says it before start. These tests run the README's blocks
with LMCache through vLLM 0.34's real scheduler and the real LMCache MP
server: kvmux refuses them (with and without ``LMCACHE_USE_UPSTREAM_MP``,
which vLLM reads at import, hence a subprocess), vLLM's own
``MultiConnector`` over the same child starts and crashes on the second
step (the failure the refusal prevents), and on vLLM 0.33 the same check
lets the child run. The model is the one stand-in (``tests.support.harness``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig

from kvmux import KvmuxConfigError, _versions
from kvmux.cli.doctor import diagnose
from tests.support.harness import SchedulerSim, upstream_config
from tests.support.lmcache_server import lmcache_refusal, time_limit
from tests.support.readme_configs import ON_THE_SCHEDULER, readme_configs, substitute

README = readme_configs()
ROOT = Path(__file__).resolve().parents[2]
ON_034 = not _versions.HAS_RESUMED_REQ_IDS
only_034 = pytest.mark.skipif(not ON_034, reason="vLLM before 0.34 keeps resumed_req_ids")

#: What every refusal on vLLM 0.34 with lmcache 0.5.6 names: the cause and
#: the fix that works (the other LMCache path fails too, see the docstring).
FIX = "run vLLM 0.33 with lmcache 0.5.6"


def lmcache_child(port: int) -> dict:
    return {
        "kv_connector": "LMCacheMPConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.port": port},
    }


@only_034
@pytest.mark.parametrize("readme_id", list(ON_THE_SCHEDULER))
def test_the_readme_lmcache_blocks_are_refused_at_start_up_with_the_fix(
    readme_id, lmcache_server, model_dir
):
    """Under either name (the quick start's ``KvmuxConnector``, the
    ``MultiConnector`` block): refused while vLLM builds the connector, the
    message naming the removed field, the versions and the fix."""
    cfg = substitute(
        README[readme_id].config, capacity_gib=0.01, lmcache_mp_port=lmcache_server.port
    )
    with pytest.raises(KvmuxConfigError) as e:
        SchedulerSim(KVTransferConfig(**cfg), model_dir=model_dir)
    msg = str(e.value)
    assert "resumed_req_ids" in msg and "lmcache 0.5.6" in msg and "vLLM 0.34" in msg
    assert "crash the engine mid-serving" in msg
    assert FIX in msg and "upgrade lmcache" in msg
    # The other way round is named as failing too, not offered as a fix.
    assert "LMCACHE_USE_UPSTREAM_MP=1 does not help" in msg


@only_034
def test_with_lmcache_use_upstream_mp_the_quick_start_is_refused_too(lmcache_server, model_dir):
    """``LMCACHE_USE_UPSTREAM_MP=1`` picks vLLM's built-in connector, which
    lmcache 0.5.6's adapter does not fit: refused with that cause and fix
    (the variable is read at import: a fresh interpreter)."""
    cfg = substitute(
        README["quickstart"].config, capacity_gib=0.01, lmcache_mp_port=lmcache_server.port
    )
    code = (
        "import json, sys\n"
        "from vllm.config import KVTransferConfig\n"
        "from kvmux import KvmuxConfigError\n"
        "from tests.support.harness import SchedulerSim\n"
        "try:\n"
        "    SchedulerSim(KVTransferConfig(**json.loads(sys.argv[1])), model_dir=sys.argv[2])\n"
        "except KvmuxConfigError as e:\n"
        "    print('REFUSED:', e)\n"
        "else:\n"
        "    print('STARTED')\n"
    )
    env = {**os.environ, "LMCACHE_USE_UPSTREAM_MP": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(cfg), str(model_dir)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(x for x in out.stdout.splitlines() if x.startswith(("REFUSED", "STARTED")))
    assert line.startswith("REFUSED"), line
    assert "LMCACHE_USE_UPSTREAM_MP is set" in line and "fails at start-up" in line
    assert "server_url=" in line and FIX in line


@only_034
def test_doctor_names_the_crash_and_the_fix_before_start():
    for readme_id in ON_THE_SCHEDULER:
        rep = diagnose(README[readme_id].config)
        assert not rep.ok
        assert any("resumed_req_ids" in p and FIX in p for p in rep.problems), rep.problems
    # LMCache alone, not behind kvmux: doctor says it as well.
    rep = diagnose(lmcache_child(5555))
    assert any("resumed_req_ids" in p and FIX in p for p in rep.problems), rep.problems


@only_034
def test_vllms_multiconnector_over_the_same_child_starts_and_crashes_at_the_first_decode(
    lmcache_server, model_dir
):
    """What the refusal prevents: vLLM's own ``MultiConnector`` over
    lmcache 0.5.6's connector starts, runs the prefill, and the engine's
    scheduler raises on the request's second step."""
    d = SchedulerSim(upstream_config([lmcache_child(lmcache_server.port)]), model_dir=model_dir)
    try:
        d.add("A", list(range(100, 140)), max_tokens=4)
        with time_limit(60), pytest.raises(AttributeError, match="resumed_req_ids"):
            # Until the crash, by time, not by a count of steps: LMCache
            # answers lookups asynchronously ("not ready" until its server
            # replies), and on a fast machine 200 steps passed before it did.
            while d.scheduler.requests:
                d.step()
                time.sleep(0.001)
        assert "A" not in d.finished, "the request finished: the crash did not happen"
    finally:
        d.close()


@pytest.mark.skipif(ON_034, reason="vLLM 0.34 removed resumed_req_ids")
def test_on_vllm_033_lmcache_is_not_refused():
    """The check is decided by what the installed vLLM and LMCache can do:
    on vLLM 0.33 lmcache 0.5.6's connector runs (``tests/mux/test_lmcache.py``
    serves through it), so nothing is refused and doctor is clean."""
    pytest.importorskip("lmcache.v1.multiprocess.server", reason="LMCache is not installed")
    assert lmcache_refusal() is None
    assert diagnose(README["quickstart"].config).ok
