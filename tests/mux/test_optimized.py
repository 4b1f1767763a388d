"""Under ``python -O`` (asserts stripped) kvmux refuses the same things."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import sys
    if __debug__:
        raise SystemExit("not running under -O")
    from tests.support import harness as h
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from kvmux import KvmuxConfigError, KvmuxConnector, KvmuxParamClash

    S = KVConnectorRole.SCHEDULER
    seen = []

    def expect(exc, fn, *words):
        try:
            fn()
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            seen.append((exc.__name__, missing))
            return
        seen.append((exc.__name__, "did not raise"))

    def make(extra, hma=False, kvc=h.kv_cache_config):
        from vllm.config import KVTransferConfig
        ktc = KVTransferConfig(kv_connector="KvmuxConnector", kv_connector_module_path="kvmux",
                               kv_role="kv_both", kv_connector_extra_config=extra)
        return KvmuxConnector(h.vllm_config(ktc, hma=hma), S, kvc())

    expect(KvmuxConfigError, lambda: make({{"connectors": []}}), "empty")
    expect(KvmuxConfigError, lambda: make({{"connectors": [h.scripted()], "x": 1}}), "'x'")
    expect(KvmuxConfigError,
           lambda: make({{"connectors": [h.scripted()]}}, hma=True, kvc=h.hybrid_kv_cache_config),
           "ScriptedConnector", "2 KV cache groups", "--disable-hybrid-kv-cache-manager",
           '"MultiConnector"')
    # One KV cache group: HMA on runs a child without HMA support.
    plain = make({{"connectors": [h.scripted(params={{"a": 1}})]}}, hma=True)
    if plain.request_finished_all_groups(h.make_request("p", range(32)), ([1],)) != (
        False, {{"a": 1}}
    ):
        raise SystemExit("single-group finish under -O went wrong")
    conn = make({{"connectors": [h.scripted(params={{"k": 1}}), h.scripted(params={{"k": 2}})]}})
    r = h.make_request("r", range(32))
    expect(KvmuxConfigError, lambda: conn.request_finished_all_groups(r, ([1], [2])),
           "2 cache groups")
    expect(KvmuxParamClash, lambda: conn.request_finished(r, [1]), "'k'")
    print(seen)
    assert_ok = all(m == [] for _, m in seen) and len(seen) == 5
    sys.exit(0 if assert_ok else 1)
    """
)


def test_errors_are_raised_the_same_under_python_O():
    # From the repository root, which holds the tests package (tests.support.harness).
    proc = subprocess.run(
        [sys.executable, "-O", "-c", SCRIPT.format()],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
