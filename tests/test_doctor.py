"""``python -m kvmux doctor CONFIG`` checks a configuration before vLLM runs."""

from __future__ import annotations

import json
import subprocess
import sys

from kvmux.cli.doctor import diagnose
from test_faults import BAD_CONFIGS

HOST = {
    "kv_connector": "KvmuxHostCache",
    "kv_connector_module_path": "kvmux",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"capacity_gib": 2},
}
GOOD = {
    "kv_connector": "MultiConnector",
    "kv_connector_module_path": "kvmux",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {
        "connectors": [HOST, {"kv_connector": "ExampleConnector", "kv_role": "kv_both"}]
    },
}


def doctor(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvmux", "doctor", *args],
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_valid_config_passes_and_lists_children_hma_and_layout(tmp_path):
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(GOOD))
    proc = doctor(str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    out = proc.stdout
    assert "child KvmuxHostCache: kvmux.host_cache.connector.KvmuxHostCache (no HMA)" in out
    assert "child ExampleConnector" in out
    assert "vLLM will turn the hybrid KV cache manager off" in out
    assert "KV cache layout required: any" in out
    assert out.rstrip().endswith("OK")


def test_every_problem_is_named_with_a_non_zero_exit():
    bad = {
        **GOOD,
        "kv_connector": "KvmuxConnector",
        "kv_connector_extra_config": {
            "connectors": [{**HOST, "kv_connector_extra_config": {}}, {"kv_connector": "Nope"}],
            "clash_policy": "loud",
        },
    }
    proc = doctor("--json", json.dumps(bad))
    assert proc.returncode == 1
    rep = json.loads(proc.stdout)
    assert not rep["ok"] and len(rep["problems"]) == 3
    text = " ".join(rep["problems"])
    assert "clash_policy='loud'" in text and "capacity_gib" in text and "Nope" in text


def test_unreadable_input_exits_2():
    proc = doctor("{not json")
    assert proc.returncode == 2 and "cannot read the config" in proc.stdout


def test_doctor_finds_every_case_of_the_bad_config_matrix():
    for case, extra, hma, words in BAD_CONFIGS:
        if hma:  # HMA is decided by vLLM at start-up: doctor warns instead
            rep = diagnose(
                {**GOOD, "kv_connector": "KvmuxConnector", "kv_connector_extra_config": extra}
            )
            assert rep.ok and any("--disable-hybrid-kv-cache-manager" in w for w in rep.warnings), (
                case
            )
            continue
        rep = diagnose(
            {
                "kv_connector": "KvmuxConnector",
                "kv_connector_module_path": "kvmux",
                "kv_role": "kv_both",
                "kv_connector_extra_config": extra,
            }
        )
        assert not rep.ok, case
        text = " ".join(rep.problems)
        for w in words:
            assert w in text, (case, text)


def test_a_single_kvmux_host_cache_config_is_checked_too():
    assert diagnose(HOST).ok
    rep = diagnose({**HOST, "kv_connector_extra_config": {"num_blocks": -1}})
    assert rep.problems == ["KvmuxHostCache: num_blocks must be a positive integer, got -1"]
