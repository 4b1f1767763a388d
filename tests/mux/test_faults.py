"""Misbehaving children and malformed configurations.

Children that fail are ``tests/support/scripted.py`` connectors told to raise or to
return malformed values: stand-ins for third-party connectors with bugs."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

from kvmux import KvmuxChildError, KvmuxConfigError, KvmuxConnector
from tests.support.harness import (
    NOOP,
    child,
    hybrid_kv_cache_config,
    kv_cache_config,
    mux_config,
    scripted,
    vllm_config,
)

SCHED, WORKER = KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER


def build(children, role=SCHED, **extra):
    return KvmuxConnector(vllm_config(mux_config(children, **extra)), role, kv_cache_config())


# ------------------------------------------------------------ child faults


@pytest.mark.parametrize(
    "hook", ["get_num_new_matched_tokens", "update_state_after_alloc", "request_finished"]
)
def test_a_child_raising_on_a_request_is_named_and_kvmux_forgets_the_request(h, hook):
    # Without a breaker: a raising lookup fails the call too (with one, the
    # default, it is a contained miss: tests/mux/test_breaker.py).
    conn = build([scripted(matched=32), scripted(fail=hook)], breaker_failures=None)
    r = h.make_request("r", range(64))
    with pytest.raises(KvmuxChildError) as err:
        conn.get_num_new_matched_tokens(r, 0)
        conn.update_state_after_alloc(r, None, 32)
        conn.request_finished(r, [0, 1])
    e = err.value
    assert (e.child, e.hook) == ("ScriptedConnector#1", hook)
    assert isinstance(e.__cause__, RuntimeError) and "scripted failure" in str(e)
    assert conn.num_live_requests() == 0


@pytest.mark.parametrize("hook", ["start_load_kv", "wait_for_save", "get_finished"])
def test_a_child_raising_in_a_worker_hook_is_named(hook):
    from kvmux.mux.metadata import KvmuxMetadata
    from tests.support.scripted import ScriptedMetadata

    w = build([child("NoopConnector", module=NOOP), scripted(fail=hook)], role=WORKER)
    w.bind_connector_metadata(KvmuxMetadata(children=(ScriptedMetadata([]),) * 2))
    # vLLM 0.33 collects completions through get_transfer_results (which calls
    # the child's get_finished).
    expect = "get_(finished|transfer_results)" if hook == "get_finished" else hook
    with pytest.raises(KvmuxChildError, match=f"'ScriptedConnector' failed in {expect}"):
        w.start_load_kv(None)
        w.wait_for_save()
        w.get_finished(set())


def test_a_failing_child_through_the_real_scheduler_reaches_vllm_named(driver_factory):
    d = driver_factory(mux_config([scripted(), scripted(fail="request_finished")]))
    d.add("r", list(range(40)))
    with pytest.raises(KvmuxChildError, match="ScriptedConnector#1"):
        d.run()
    assert d.connector.num_live_requests() == 0


@pytest.mark.parametrize(
    ("answer", "words"),
    [
        ((-16, False), ["negative token count -16"]),
        (("16", False), ["token count '16'"]),
        ((16.0, False), ["token count 16.0"]),
        ((0, True), ["load_async=True with 0 tokens"]),
        ((16, "yes"), ["load_async 'yes'"]),
        ([16, False], ["returned [16, False]"]),
        ((16,), ["tuple of 1 items"]),
        (None, ["returned None"]),
    ],
)
def test_malformed_lookup_answers_are_refused_naming_the_child(h, answer, words):
    conn = build([scripted(), scripted(raw_answer=answer)])
    with pytest.raises(KvmuxChildError) as err:
        conn.get_num_new_matched_tokens(h.make_request("r", range(40)), 0)
    msg = str(err.value)
    assert "ScriptedConnector#1" in msg and "get_num_new_matched_tokens" in msg
    assert "(int >= 0 or None, bool)" in msg
    for w in words:
        assert w in msg
    assert conn.num_live_requests() == 0


@pytest.mark.parametrize(
    ("result", "words"),
    [
        ((False, ["x"]), ["params ['x']"]),
        ((1, None), ["async_save"]),
        ("done", ["returned 'done'"]),
        ((False, {1: "a"}), ["key 1 that is not a str"]),
    ],
)
def test_malformed_finish_results_are_refused_naming_the_child(h, result, words):
    conn = build([scripted(params={"a": 1}), scripted(raw_finish=result)])
    r = h.make_request("r", range(40))
    conn.get_num_new_matched_tokens(r, 0)
    with pytest.raises(KvmuxChildError) as err:
        conn.request_finished(r, [])
    for w in ["ScriptedConnector#1", "request_finished", *words]:
        assert w in str(err.value)
    assert conn.num_live_requests() == 0


# -------------------------------------------------------- bad input matrix

HOST = {"kv_connector": "KvmuxHostCache", "kv_connector_module_path": "kvmux", "kv_role": "kv_both"}
SCR = {
    "kv_connector": "ScriptedConnector",
    "kv_connector_module_path": "tests.support.scripted",
    "kv_role": "kv_both",
}

#: (case, kv_connector_extra_config, hma on?, words the error must contain)
BAD_CONFIGS = [
    ("no connectors", {}, False, ['"connectors"', "add one child"]),
    ("connectors a dict", {"connectors": SCR}, False, ['"connectors" is a dict', "list"]),
    ("connectors a string", {"connectors": "ExampleConnector"}, False, ["list"]),
    ("connectors empty", {"connectors": []}, False, ["empty"]),
    ("too many children", {"connectors": [SCR] * 65}, False, ["at most 64"]),
    ("unknown key", {"connectors": [SCR], "clash": "first"}, False, ["'clash'", "clash_policy"]),
    (
        "clash_policy wrong type",
        {"connectors": [SCR], "clash_policy": 1},
        False,
        ["clash_policy=1", "'error'"],
    ),
    (
        "clash_policy unknown",
        {"connectors": [SCR], "clash_policy": "fist"},
        False,
        ["did you mean 'first'"],
    ),
    (
        "load_policy unknown",
        {"connectors": [SCR], "load_policy": None},
        False,
        ["load_policy=None"],
    ),
    ("child not a dict", {"connectors": [SCR, 3]}, False, ["connectors[1] is a int"]),
    (
        "child without class",
        {"connectors": [{"kv_role": "kv_both"}]},
        False,
        ["connectors[0]", "'kv_connector'"],
    ),
    (
        "child bad role",
        {"connectors": [{**SCR, "kv_role": "both"}]},
        False,
        ["connectors[0]", "kv_role"],
    ),
    (
        "child unknown field",
        {"connectors": [{**SCR, "kv_port": "x", "colour": 1}]},
        False,
        ["connectors[0]", "colour"],
    ),
    (
        "unknown class",
        {"connectors": [{"kv_connector": "Nope", "kv_role": "kv_both"}]},
        False,
        ["Nope", "kv_connector_module_path"],
    ),
    (
        "unknown module",
        {"connectors": [{**SCR, "kv_connector_module_path": "nope_mod"}]},
        False,
        ["nope_mod", "installed"],
    ),
    (
        "class not a connector",
        {
            "connectors": [
                {
                    "kv_connector": "KvmuxConfigError",
                    "kv_connector_module_path": "kvmux",
                    "kv_role": "kv_both",
                }
            ]
        },
        False,
        ["connectors[0] (KvmuxConfigError) cannot be loaded", "constructor"],
    ),
    (
        "duplicate names",
        {"connectors": [{**SCR, "name": "a"}, {**SCR, "name": "a"}]},
        False,
        ["share the name 'a'", "distinct"],
    ),
    ("empty name", {"connectors": [{**SCR, "name": " "}]}, False, ["non-empty string"]),
    (
        "host cache without capacity",
        {"connectors": [HOST]},
        False,
        ["connectors[0] (KvmuxHostCache)", "capacity_gib"],
    ),
    (
        "host cache negative",
        {"connectors": [{**HOST, "kv_connector_extra_config": {"capacity_gib": -2}}]},
        False,
        ["capacity_gib must be a positive"],
    ),
    (
        "host cache both",
        {
            "connectors": [
                {**HOST, "kv_connector_extra_config": {"capacity_gib": 1, "num_blocks": 9}}
            ]
        },
        False,
        ["not both"],
    ),
    (
        "host cache unknown key",
        {"connectors": [{**HOST, "kv_connector_extra_config": {"num_blocks": 9, "size": 1}}]},
        False,
        ["'size'"],
    ),
    (
        "nested kvmux bad",
        {
            "connectors": [
                {
                    "kv_connector": "KvmuxConnector",
                    "kv_connector_module_path": "kvmux",
                    "kv_role": "kv_both",
                    "kv_connector_extra_config": {"connectors": []},
                }
            ]
        },
        False,
        ["connectors[0] (KvmuxConnector)", "empty"],
    ),
    (
        "HMA mismatch",
        {"connectors": [SCR, {**HOST, "kv_connector_extra_config": {"num_blocks": 8}}]},
        True,
        [
            "ScriptedConnector",
            "2 KV cache groups",
            "--disable-hybrid-kv-cache-manager",
            '"MultiConnector"',
        ],
    ),
]


def construct(extra, hma):
    """Build kvmux; ``hma`` True: HMA on and a hybrid model (two KV cache groups)."""
    ktc = KVTransferConfig(
        kv_connector="KvmuxConnector",
        kv_connector_module_path="kvmux",
        kv_role="kv_both",
        kv_connector_extra_config=extra,
    )
    kvc = hybrid_kv_cache_config() if hma else kv_cache_config()
    return KvmuxConnector(vllm_config(ktc, hma=hma), SCHED, kvc)


@pytest.mark.parametrize(
    ("case", "extra", "hma", "words"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_matrix_is_refused_at_construction(case, extra, hma, words):
    with pytest.raises(KvmuxConfigError) as err:
        construct(extra, hma)
    for w in words:
        assert w in str(err.value), (case, str(err.value))


def test_bad_config_matrix_is_refused_the_same_under_python_O():
    """Each case raises the same message with asserts stripped."""
    script = textwrap.dedent("""
        import json
        if __debug__:
            raise SystemExit("not under -O")
        from tests.mux.test_faults import BAD_CONFIGS, construct
        out = {}
        for case, extra, hma, _ in BAD_CONFIGS:
            try:
                construct(extra, hma)
                out[case] = None
            except Exception as e:
                out[case] = [type(e).__name__, str(e)]
        print("RESULT" + json.dumps(out))
    """)
    proc = subprocess.run(
        [sys.executable, "-O", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=Path(__file__).resolve().parents[2],  # the repository root: the tests package
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.split("RESULT", 1)[1])
    for case, _, _, words in BAD_CONFIGS:
        kind, msg = got[case]
        assert kind == "KvmuxConfigError", (case, kind, msg)
        for w in words:
            assert w in msg, (case, msg)


def test_kvmuxs_child_keys_under_the_multiconnector_name_are_refused_with_the_fix():
    """vLLM parses every child entry itself under the name MultiConnector
    (its HMA check) and would fail on kvmux's keys with a bare pydantic
    error; kvmux names the key and both fixes first."""
    ktc = mux_config([{**scripted(), "lookup_timeout_ms": 100}], name="MultiConnector")
    with pytest.raises(KvmuxConfigError) as err:
        KvmuxConnector.validate_transfer_config(ktc)
    text = str(err.value)
    assert "connectors[0] sets 'lookup_timeout_ms'" in text
    assert "kv_connector_extra_config" in text and '"KvmuxConnector"' in text
    # Global, it is accepted under that name.
    KvmuxConnector.validate_transfer_config(
        mux_config([scripted()], name="MultiConnector", lookup_timeout_ms=100)
    )
