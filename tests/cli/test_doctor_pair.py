"""``python -m kvmux doctor PREFILL --peer DECODE``: what NIXL needs a
prefill/decode pair to agree on, checked from the two configs before either
instance starts (``kvmux.cli.pd_pair``). The pairs the README shows pass
(the P/D suite, ``tests/pd``, starts them and checks that the hybrid-manager
decision predicted here is the engines'); each way a pair can disagree is a
problem naming both sides and the fix, with exit status 1."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvmux.cli.doctor import diagnose, diagnose_pair
from tests.cli.test_doctor import doctor
from tests.support.readme_configs import PD_CONFIGS, readme_configs

README = readme_configs()
NIXL_P = {"kv_connector": "NixlConnector", "kv_role": "kv_producer"}
NIXL_D = {"kv_connector": "NixlConnector", "kv_role": "kv_consumer"}
FILES = {
    "kv_connector": "ExampleConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": {"shared_storage_path": "/var/tmp/kvmux-example"},
}


def mux(name: str, *children: dict[str, Any], role: str = "kv_both") -> dict[str, Any]:
    """kvmux over ``children``; ``role``, the top-level ``kv_role``, must
    agree with the children's on vLLM 0.34 (``kvmux.mux.parent_name``)."""
    return {
        "kv_connector": name,
        "kv_connector_module_path": "kvmux",
        "kv_role": role,
        "kv_connector_extra_config": {"connectors": list(children)},
    }


def pair(prefill: dict[str, Any], decode: dict[str, Any], **flags: bool) -> Any:
    return diagnose_pair(diagnose(prefill), prefill, decode, **flags)


READMES_PAIRS = [
    ("pd-prefill", "pd-decode"),
    ("pd-prefill", "pd-decode-nixl"),
    ("pd-prefill-push", "pd-decode-push"),
    ("pd-prefill-push", "pd-decode-push-deadline"),
]


def test_every_readme_pd_block_is_in_a_checked_pair():
    assert {i for p in READMES_PAIRS for i in p} == set(PD_CONFIGS)
    for prefill, decode in READMES_PAIRS:
        assert PD_CONFIGS[prefill][0] == "prefill" and PD_CONFIGS[decode][0] == "decode"
        assert PD_CONFIGS[prefill][1] == PD_CONFIGS[decode][1]


@pytest.mark.parametrize(("prefill", "decode"), READMES_PAIRS)
def test_the_readmes_pairs_agree(prefill: str, decode: str):
    rep = pair(README[prefill].config, README[decode].config)
    assert rep.ok, rep.pair_problems + rep.problems
    mode = PD_CONFIGS[prefill][1]
    assert any(f"NIXL: {mode} on both" in n for n in rep.pair)
    assert "hybrid KV cache manager: on on both (NIXL's compatibility hash includes it)" in rep.pair


def test_a_multiconnector_prefill_with_a_child_lacking_hma_breaks_a_plain_nixl_decode():
    """ai-dynamo/dynamo#12821: under the name MultiConnector vLLM turns the
    hybrid manager off when a child lacks HMA support; the plain NIXL decode
    keeps it on; NIXL's hash differs. The same children under kvmux's own
    name agree with the decode: kvmux's default is the safe one."""
    rep = pair(mux("MultiConnector", NIXL_P, FILES), NIXL_D)
    assert not rep.ok
    (problem,) = rep.pair_problems
    assert "off on the prefill" in problem and "on on the decode" in problem
    assert "['ExampleConnector'] lack HMA support" in problem
    assert "NIXL compatibility hash mismatch" in problem
    assert '"KvmuxConnector"' in problem and "--disable-hybrid-kv-cache-manager" in problem
    assert pair(mux("KvmuxConnector", NIXL_P, FILES), NIXL_D).ok


def test_vllms_own_multiconnector_is_checked_the_same_way():
    multi = {**mux("MultiConnector", NIXL_P, FILES)}
    del multi["kv_connector_module_path"]
    rep = pair(multi, NIXL_D)
    (problem,) = rep.pair_problems
    assert "off on the prefill" in problem and 'run the prefill with "KvmuxConnector"' in problem


def test_the_hybrid_manager_flag_must_be_given_to_both_or_neither():
    prefill, decode = README["pd-prefill"].config, README["pd-decode-nixl"].config
    rep = pair(prefill, decode, peer_disable_hma=True)
    (problem,) = rep.pair_problems
    assert "on on the prefill" in problem and "off on the decode" in problem
    assert "--disable-hybrid-kv-cache-manager is given" in problem
    both = pair(prefill, decode, disable_hma=True, peer_disable_hma=True)
    assert both.ok and "hybrid KV cache manager: off on both" in " ".join(both.pair)


def test_push_against_pull_is_refused():
    rep = pair(README["pd-prefill"].config, README["pd-decode-push"].config)
    (problem,) = rep.pair_problems
    assert "by pull" in problem and "by push" in problem and "NixlPushConnector on both" in problem


@pytest.mark.parametrize(
    ("prefill", "decode", "words"),
    [
        (
            mux("KvmuxConnector", FILES),
            NIXL_D,
            "the prefill (KvmuxConnector) has no NIXL connector",
        ),
        (NIXL_P, FILES, "the decode (ExampleConnector) has no NIXL connector"),
        (
            NIXL_P,
            {**NIXL_D, "kv_role": "kv_producer"},
            "does not receive KV",
        ),
        (
            {**NIXL_P, "kv_role": "kv_consumer"},
            NIXL_D,
            "does not send KV",
        ),
        (
            {**NIXL_P, "kv_connector_extra_config": {"backends": ["LIBFABRIC"]}},
            NIXL_D,
            "share none",
        ),
        (
            mux("KvmuxConnector", NIXL_P, {**NIXL_P, "name": "second"}, role="kv_producer"),
            NIXL_D,
            "lists 2 NIXL connectors",
        ),
    ],
)
def test_each_disagreement_is_named_with_its_fix(
    prefill: dict[str, Any], decode: dict[str, Any], words: str
):
    rep = pair(prefill, decode)
    assert not rep.ok
    assert any(words in p for p in rep.pair_problems), rep.pair_problems


def test_a_pair_that_skips_nixls_check_is_warned_about():
    prefill = {**NIXL_P, "kv_connector_extra_config": {"enforce_handshake_compat": False}}
    rep = pair(prefill, NIXL_D)
    assert rep.ok
    assert any("enforce_handshake_compat false" in w for w in rep.warnings)


def test_a_broken_side_is_reported_before_the_pair_is_compared():
    rep = pair(README["pd-prefill"].config, {"kv_connector": "Nope", "kv_role": "kv_consumer"})
    assert not rep.ok and rep.peer is not None and rep.peer.problems
    assert rep.pair == ["not compared: fix each side's own problems first"]


def test_the_command_line_checks_a_pair_and_exits_1_on_a_mismatch(tmp_path):
    prefill = tmp_path / "prefill.json"
    prefill.write_text(json.dumps(mux("MultiConnector", NIXL_P, FILES)))
    proc = doctor(str(prefill), "--peer", json.dumps(NIXL_D))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "prefill/decode pair:" in proc.stdout
    assert "NIXL compatibility hash mismatch" in proc.stdout
    ok = doctor(json.dumps(README["pd-prefill"].config), "--peer", json.dumps(NIXL_D), "--json")
    assert ok.returncode == 0, ok.stdout + ok.stderr[-2000:]
    rep = json.loads(ok.stdout)
    assert rep["ok"] and rep["peer"]["connector"] == "NixlConnector" and rep["pair_problems"] == []
