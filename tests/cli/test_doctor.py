"""``python -m kvmux doctor CONFIG`` checks a configuration before vLLM runs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvmux.cli.doctor import diagnose
from kvmux.cli.model_kv import read_model_kv
from tests.mux.test_faults import BAD_CONFIGS

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


LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 2}
#: Gemma 3 as transformers writes it: five sliding-window layers per global one.
GEMMA3 = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "num_hidden_layers": 6,
    "sliding_window": 512,
    "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
}
#: Jamba: one attention layer in every 8, the rest Mamba.
JAMBA = {
    "architectures": ["JambaForCausalLM"],
    "model_type": "jamba",
    "num_hidden_layers": 8,
    "attn_layer_period": 8,
    "attn_layer_offset": 4,
}
KVMUX_NAMED = {**GOOD, "kv_connector": "KvmuxConnector"}


def model_folder(tmp_path, cfg) -> str:
    folder = tmp_path / cfg["model_type"]
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return str(folder)


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
    assert "child KvmuxHostCache: kvmux.host_cache.connector.KvmuxHostCache (HMA)" in out
    assert "child ExampleConnector" in out and "(no HMA)" in out
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


def test_doctor_finds_every_case_of_the_bad_config_matrix(tmp_path):
    hybrid = read_model_kv(model_folder(tmp_path, GEMMA3))
    for case, extra, hma, words in BAD_CONFIGS:
        if hma:  # a hybrid model: doctor names the problem given the model
            cfg = {**GOOD, "kv_connector": "KvmuxConnector", "kv_connector_extra_config": extra}
            assert diagnose(cfg).ok, case  # plain models run
            rep = diagnose(cfg, hybrid)
            text = " ".join(rep.problems)
            for w in ["ScriptedConnector", "--disable-hybrid-kv-cache-manager"]:
                assert w in text, (case, text)
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


# ------------------------------------------------ hybrid KV cache manager


def test_a_kvmux_named_config_says_plain_models_run_and_what_hybrid_ones_need():
    proc = doctor(json.dumps(KVMUX_NAMED))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    out = " ".join(proc.stdout.split())
    assert "plain models (one KV cache group) run as configured" in out
    assert "hybrid models (several groups) are refused at start-up" in out
    assert "--disable-hybrid-kv-cache-manager" in out and '"MultiConnector"' in out


def test_with_a_plain_model_the_config_runs_as_it_is(tmp_path):
    proc = doctor(json.dumps(KVMUX_NAMED), "--model", model_folder(tmp_path, LLAMA))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert "model: LlamaForCausalLM: 2 full_attention layers -> one KV cache group" in proc.stdout


def test_with_a_hybrid_model_doctor_names_the_children_and_both_fixes(tmp_path):
    proc = doctor("--json", json.dumps(KVMUX_NAMED), "--model", model_folder(tmp_path, GEMMA3))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    rep = json.loads(proc.stdout)
    assert "5 sliding_attention, 1 full_attention" in rep["model"]
    (problem,) = rep["problems"]
    assert "['ExampleConnector'] lack HMA support" in problem
    assert "--disable-hybrid-kv-cache-manager" in problem and '"MultiConnector"' in problem


def test_the_multiconnector_name_serves_a_sliding_window_hybrid(tmp_path):
    proc = doctor(json.dumps(GOOD), "--model", model_folder(tmp_path, GEMMA3))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]


@pytest.mark.parametrize("config", [GOOD, KVMUX_NAMED], ids=["MultiConnector", "KvmuxConnector"])
def test_a_state_space_hybrid_needs_children_that_all_support_hma(tmp_path, config):
    rep = diagnose(config, read_model_kv(model_folder(tmp_path, JAMBA)))
    assert not rep.ok
    assert "state-space layers" in rep.problems[0]
    assert "use only children that support HMA" in rep.problems[0]


def test_a_model_folder_without_config_json_exits_2(tmp_path):
    proc = doctor(json.dumps(GOOD), "--model", str(tmp_path))
    assert proc.returncode == 2 and "has no config.json" in proc.stdout


@pytest.mark.parametrize(
    ("cfg", "layers"),
    [
        (LLAMA, {"full_attention": 2}),
        (GEMMA3, {"sliding_attention": 5, "full_attention": 1}),
        (JAMBA, {"state_space": 7, "full_attention": 1}),
        # Mistral: every layer the same window, one group.
        (
            {"model_type": "mistral", "num_hidden_layers": 4, "sliding_window": 4096},
            {"sliding_attention": 4},
        ),
        # Gemma 2 as older transformers wrote it: every second layer global.
        (
            {
                "model_type": "gemma2",
                "num_hidden_layers": 4,
                "sliding_window": 4096,
                "sliding_window_pattern": 2,
            },
            {"sliding_attention": 2, "full_attention": 2},
        ),
        # Qwen 2 with its window switched off.
        (
            {
                "model_type": "qwen2",
                "num_hidden_layers": 4,
                "sliding_window": 4096,
                "use_sliding_window": False,
            },
            {"full_attention": 4},
        ),
        # Qwen3-Next: linear attention (state) beside full attention.
        (
            {
                "model_type": "qwen3_next",
                "num_hidden_layers": 4,
                "layer_types": ["linear_attention"] * 3 + ["full_attention"],
            },
            {"state_space": 3, "full_attention": 1},
        ),
        # NemotronH: the pattern string.
        (
            {"model_type": "nemotron_h", "num_hidden_layers": 4, "hybrid_override_pattern": "M-M*"},
            {"state_space": 2, "full_attention": 1},
        ),
        # A multimodal config: the text model's layers count.
        (
            {"model_type": "gemma3", "text_config": GEMMA3},
            {"sliding_attention": 5, "full_attention": 1},
        ),
    ],
)
def test_layer_kinds_are_read_from_config_json(tmp_path, cfg, layers):
    cfg = {"model_type": "x", **cfg}
    assert read_model_kv(model_folder(tmp_path, cfg)).layers == layers


def test_doctor_prints_the_source_each_childs_hits_are_counted_under(lmcache_runs):
    """How vLLM's ``prompt_tokens_cached_by_source`` will label each child's
    hits: the host tier as host, NIXL as p2p, LMCache (which declares
    nothing) as external_unspecified, a connector that splits its own hits
    (vLLM's OffloadingConnector) by its split."""
    cfg = {
        **GOOD,
        "kv_connector_extra_config": {
            "connectors": [
                HOST,
                {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both"},
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                {"kv_connector": "OffloadingConnector", "kv_role": "kv_both"},
            ]
        },
    }
    proc = doctor(json.dumps(cfg))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    lines = {ln.split(":")[0].strip(): ln for ln in proc.stdout.splitlines() if "child " in ln}
    assert lines["child KvmuxHostCache"].endswith('its hits count as source="host"')
    assert lines["child LMCacheMPConnector"].endswith('source="external_unspecified"')
    assert lines["child NixlConnector"].endswith('its hits count as source="p2p"')
    assert "its own split by source" in lines["child OffloadingConnector"]
    rep = diagnose(HOST)
    assert rep.children[0]["hit_source"] == 'source="host"'


def test_doctor_says_where_example_connector_keeps_each_models_files(tmp_path):
    """One folder per model under ``shared_storage_path`` (issue 46), and a
    warning when the path is not set (vLLM's default, /tmp)."""
    unset = diagnose(GOOD)
    (files,) = [c for c in unset.children if c["name"] == "ExampleConnector"]
    assert files["storage"].startswith("/tmp/kvmux-<model>-<digest>: one folder per model")
    assert any("shared_storage_path is not set" in w for w in unset.warnings), unset.warnings
    ex = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": "/srv/kv"},
    }
    set_ = diagnose({**GOOD, "kv_connector_extra_config": {"connectors": [HOST, ex]}})
    assert set_.ok and set_.warnings == [], set_.warnings
    (files,) = [c for c in set_.children if c["name"] == "ExampleConnector"]
    assert files["storage"].startswith("/srv/kv/kvmux-<model>-<digest>")
    path = tmp_path / "kv.json"
    path.write_text(json.dumps(GOOD))
    out = doctor(str(path)).stdout
    assert "    files: /tmp/kvmux-<model>-<digest>: one folder per model" in out
    assert "warning: ExampleConnector: shared_storage_path is not set" in out
