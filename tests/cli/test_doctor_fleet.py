"""``python -m kvmux doctor A --fleet B``: what instances sharing KV through
LMCache's distributed store must agree on (``kvmux.cli.fleet``), checked
from each instance's ``vllm serve`` and LMCache server command lines, both
parsed by vLLM's and LMCache's own parsers. The documented pair (README's
quick start, the LMCache server of docs/many-instances.md) passes, and so
does docs/doctor.md's example, with the output shown there; each way a
fleet can disagree is a problem naming the instances and the fix."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from kvmux.cli.fleet import (
    NEVER_HITS,
    REFUSES,
    WRONG_KV,
    FleetReport,
    InstanceFileError,
    check_fleet,
    parse_instance,
)
from tests.cli.test_doctor import doctor
from tests.support.readme_configs import ROOT, readme_configs, substitute

# Every instance here serves the quick start (LMCache): on a vLLM where kvmux
# refuses LMCache (lmcache 0.5.6 on 0.34) each would report that refusal;
# skipped there with it (tests/mux/test_lmcache_vllm034.py tests the refusal).
pytestmark = pytest.mark.usefixtures("lmcache_runs")

QUICKSTART = readme_configs()["quickstart"].config
NO_SERVICE = readme_configs()["no-service"].config
MODEL = "Qwen/Qwen3-8B"


def _doc_server() -> str:
    """The LMCache server command of docs/many-instances.md, as written."""
    text = (ROOT / "docs" / "many-instances.md").read_text()
    m = re.search(
        r"```bash\n\s*(LMCACHE_TRACK_USAGE=false python -m lmcache\.v1\.multiprocess\.server"
        r".*?)```",
        text,
        re.S,
    )
    assert m is not None, "docs/many-instances.md lost its LMCache server command"
    return m.group(1)


DOC_SERVER = _doc_server()


def server(port: int = 5555, drop: tuple[str, ...] = (), **flags: str) -> list[str]:
    """The documented server command with ``--port`` (a resource) and the
    given flags (``chunk_size="32"``) set, and the flags in ``drop`` removed."""
    words = shlex.split(DOC_SERVER.replace("\\\n", " "))
    values = {"--port": str(port), **{"--" + k.replace("_", "-"): v for k, v in flags.items()}}
    out: list[str] = []
    it = iter(words)
    for w in it:
        if w in drop:
            next(it)
        elif w in values:
            out += [w, values.pop(w)]
            next(it)
        else:
            out.append(w)
    return out + [x for k, v in values.items() for x in (k, v)]


def store(host: str = "127.0.0.1", port: int = 6379) -> str:
    return json.dumps({"type": "resp", "host": host, "port": port})


def instance(
    name: str,
    port: int = 5555,
    *,
    model: str = MODEL,
    flags: tuple[str, ...] = ("--block-size", "16"),
    config: dict[str, Any] | None = None,
    server_cmd: list[str] | None = None,
    host: str | None = None,
) -> dict[str, Any]:
    """One instance: the README's quick start served with ``flags`` (its
    LMCache port set to ``port``) beside the documented LMCache server."""
    cfg = substitute(QUICKSTART, lmcache_mp_port=port) if config is None else config
    out: dict[str, Any] = {
        "name": name,
        "vllm_serve": ["vllm", "serve", model, *flags, "--kv-transfer-config", json.dumps(cfg)],
        "lmcache_server": server(port) if server_cmd is None else server_cmd,
    }
    if host is not None:
        out["host"] = host
    return out


def fleet(*instances: dict[str, Any]) -> FleetReport:
    return check_fleet([parse_instance(i["name"], i) for i in instances])


def test_the_documented_pair_shares_kv():
    a, b = instance("A"), instance("B", 5556)
    rep = fleet(a, b)
    assert rep.ok, rep.problems
    assert rep.warnings == []
    assert "chunk size: 16 on every LMCache server" in rep.notes
    assert f"model: {MODEL!r} on every instance" in rep.notes
    assert "shared L2 store: resp 127.0.0.1:6379" in rep.notes
    # parsed by vLLM's parser (its defaults) and LMCache's
    ia = rep.instances[0]
    assert (ia.dtype, ia.kv_cache_dtype, ia.tensor_parallel_size) == ("auto", "auto", 1)
    assert (ia.server_port, ia.chunk_size, ia.hash_algorithm) == (5555, 16, "blake3")
    assert [c.name for c in ia.lmcache_children] == ["LMCacheMPConnector"]
    assert all(r.ok and len(r.children) == 2 for r in rep.reports)


def problem(rep: FleetReport, *words: str) -> str:
    assert not rep.ok
    hits = [p for p in rep.problems if all(w in p for w in words)]
    assert hits, rep.problems
    return hits[0]


def test_a_different_chunk_size_never_hits():
    b = instance("B", 5556, server_cmd=server(5556, chunk_size="32"))
    p = problem(fleet(instance("A"), b), "--chunk-size")
    assert "16 on A" in p and "32 on B" in p
    assert NEVER_HITS in p and "same --chunk-size" in p


def test_a_different_model_string_never_hits_and_the_served_name_does_not_count():
    b = instance("B", 5556, model="/models/qwen3-8b")
    p = problem(fleet(instance("A"), b), "model")
    assert f"{MODEL!r} on A" in p and "'/models/qwen3-8b' on B" in p
    assert NEVER_HITS in p and "not --served-model-name" in p and "one --model string" in p
    served = instance("B", 5556, flags=("--block-size", "16", "--served-model-name", "qwen"))
    rep = fleet(instance("A"), served)
    assert rep.ok, rep.problems
    assert any("--served-model-name differ" in n for n in rep.notes)


@pytest.mark.parametrize(
    ("a_dtype", "b_dtype", "words"),
    [
        ("float16", "bfloat16", WRONG_KV),
        ("float16", "float32", "GET: size header mismatch"),
    ],
)
def test_a_different_dtype_hits_keys_of_the_wrong_kv(a_dtype: str, b_dtype: str, words: str):
    a = instance("A", flags=("--block-size", "16", "--dtype", a_dtype))
    b = instance("B", 5556, flags=("--block-size", "16", "--dtype", b_dtype))
    p = problem(fleet(a, b), "KV dtype", words)
    assert f"{a_dtype!r} on A" in p and f"{b_dtype!r} on B" in p
    assert "keys hold no dtype" in p and "same --dtype" in p


def test_an_fp8_kv_cache_against_the_models_dtype_never_loads():
    a = instance("A", flags=("--block-size", "16", "--dtype", "bfloat16"))
    b = instance(
        "B", 5556, flags=("--block-size", "16", "--dtype", "bfloat16", "--kv-cache-dtype", "fp8")
    )
    p = problem(fleet(a, b), "KV dtype", NEVER_HITS)
    assert "'bfloat16' on A" in p and "'fp8_e4m3' on B" in p and "--kv-cache-dtype" in p


def test_auto_against_an_explicit_dtype_is_a_warning():
    rep = fleet(instance("A"), instance("B", 5556, flags=("--block-size", "16", "--dtype", "half")))
    assert rep.ok, rep.problems
    assert any("'auto' is the model's own dtype" in w for w in rep.warnings), rep.warnings


def test_a_block_size_that_does_not_divide_the_chunk_refuses_to_start():
    b = instance("B", 5556, flags=("--block-size", "32"))
    p = problem(fleet(instance("A"), b), "B:", "--chunk-size 16", "block size 32")
    assert REFUSES in p and "multiple of 32" in p


def test_without_a_block_size_vllms_platform_default_is_unknown():
    rep = fleet(instance("A", flags=()), instance("B", 5556))
    assert rep.ok, rep.problems
    (w,) = rep.warnings
    assert w.startswith("A gives no --block-size") and "platform" in w and REFUSES in w


def test_a_server_without_l2_shares_nothing():
    b = instance("B", 5556, server_cmd=server(5556, drop=("--l2-adapter",)))
    p = problem(fleet(instance("A"), b), "B start LMCache with no --l2-adapter")
    assert NEVER_HITS in p and "same shared store" in p


def test_servers_on_different_stores_share_nothing():
    b = instance("B", 5556, server_cmd=server(5556, l2_adapter=store(port=6380)))
    p = problem(fleet(instance("A"), b), "L2 store")
    assert "resp 127.0.0.1:6379' on A" in p and "resp 127.0.0.1:6380' on B" in p
    assert NEVER_HITS in p and "same store" in p


def test_a_loopback_store_across_hosts_is_a_warning():
    rep = fleet(instance("A", host="node-a"), instance("B", 5556, host="node-b"))
    assert rep.ok
    assert any("each instance reaches its own loopback" in w for w in rep.warnings), rep.warnings
    routable = server(5556, l2_adapter=store("10.0.0.5"))
    a = instance("A", server_cmd=server(l2_adapter=store("10.0.0.5")), host="node-a")
    rep = fleet(a, instance("B", 5556, server_cmd=routable, host="node-b"))
    assert rep.ok and rep.warnings == [], rep.warnings


def test_two_servers_on_one_port_of_one_machine_are_a_warning():
    rep = fleet(instance("A"), instance("B"))
    assert any("A, B each start an LMCache server on 127.0.0.1:5555" in w for w in rep.warnings)


def test_an_lmcache_port_that_is_not_the_instances_server_refuses_to_start():
    b = instance("B", 5556, server_cmd=server(5557))
    p = problem(fleet(instance("A"), b), "B's LMCacheMPConnector reaches tcp://127.0.0.1:5556")
    assert "listens on 127.0.0.1:5557" in p and REFUSES in p
    assert '"lmcache.mp.port": 5557' in p


def test_an_instance_without_lmcache_shares_nothing():
    b = instance("B", 5556, config=NO_SERVICE)
    p = problem(fleet(instance("A"), b), "B has no LMCacheMPConnector")
    assert "KvmuxConnector" in p and '"lmcache.mp.port": 5556' in p


def test_a_multiconnector_child_counts_too():
    lm = readme_configs()["lmcache"].config
    rep = fleet(
        instance("A", config=lm), instance("B", 5556, config=substitute(lm, lmcache_mp_port=5556))
    )
    assert rep.ok, rep.problems


@pytest.mark.parametrize(
    ("b_flags", "words"),
    [
        (("--block-size", "16", "-tp", "2"), ("TP x PP", NEVER_HITS)),
        (("--block-size", "16", "-pp", "2"), ("TP x PP", NEVER_HITS)),
    ],
)
def test_a_different_parallelism_never_hits(b_flags: tuple[str, ...], words: tuple[str, ...]):
    a = instance("A")
    p = problem(fleet(a, instance("B", 5556, flags=b_flags)), *words)
    assert "1 on A" in p and "2 on B" in p and "--tensor-parallel-size" in p


def test_the_same_world_size_split_otherwise_loads_the_wrong_slice():
    a = instance("A", flags=("--block-size", "16", "-tp", "2"))
    b = instance("B", 5556, flags=("--block-size", "16", "-pp", "2"))
    problem(fleet(a, b), "(TP, PP)", WRONG_KV)


def test_hashes_must_agree():
    b = instance("B", 5556, server_cmd=server(5556, hash_algorithm="sha256_cbor"))
    p = problem(fleet(instance("A"), b), "--hash-algorithm")
    assert "'blake3' on A" in p and "'sha256_cbor' on B" in p and NEVER_HITS in p
    xx = ["PYTHONHASHSEED=0", *server(hash_algorithm="xxhash")]
    unseeded = instance("B", 5556, server_cmd=server(5556, hash_algorithm="xxhash"))
    p = problem(fleet(instance("A", server_cmd=xx), unseeded), "PYTHONHASHSEED", "not on B")
    seeded = instance(
        "B", 5556, server_cmd=["PYTHONHASHSEED=0", *server(5556, hash_algorithm="xxhash")]
    )
    assert fleet(instance("A", server_cmd=xx), seeded).ok


def test_a_config_problem_of_one_instance_fails_the_fleet():
    broken = substitute(QUICKSTART, lmcache_mp_port=5556)
    broken["kv_connector_extra_config"]["clash_policy"] = "nope"
    rep = fleet(instance("A"), instance("B", 5556, config=broken))
    assert not rep.ok and rep.problems == []
    assert rep.reports[1].problems and not rep.reports[0].problems


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        (
            {"vllm_serve": ["vllm", "serve", MODEL, "--no-such-flag"], "lmcache_server": []},
            "vllm serve",
        ),
        (
            {
                "vllm_serve": [MODEL],
                "lmcache_server": "python -m lmcache.v1.multiprocess.server --chunk-size x",
            },
            "LMCache server's parser",
        ),
        (
            {"vllm_serve": [MODEL], "lmcache_server": ["--l2-adapter", '{"type": "nope"}']},
            "LMCache server's parser",
        ),
        ({"vllm_serve": 3, "lmcache_server": []}, "a string or a list of strings"),
    ],
)
def test_a_command_line_the_parsers_refuse_is_unreadable(raw: dict[str, Any], words: str):
    with pytest.raises(InstanceFileError, match=re.escape(words)):
        parse_instance("X", raw)


def test_the_command_line_exits_1_on_a_mismatch_and_2_on_an_unreadable_file(tmp_path: Path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(instance("A")))
    b.write_text(json.dumps(instance("B", 5556, server_cmd=server(5556, chunk_size="32"))))
    proc = doctor(str(a), "--fleet", str(b))
    assert proc.returncode == 1, proc.stdout + proc.stderr[-2000:]
    assert "fleet (what LMCache's keys need to agree on):" in proc.stdout
    assert "problem: LMCache's --chunk-size differs: 16 on A; 32 on B" in proc.stdout
    assert proc.stdout.rstrip().endswith("1 problem(s) found")
    missing = doctor(str(a), "--fleet", str(tmp_path / "nope.json"))
    assert missing.returncode == 2, missing.stdout + missing.stderr[-2000:]
    assert "nope.json" in missing.stdout and "neither a readable file nor a JSON object" in (
        missing.stdout
    )
    b.write_text('{"vllm_serve": "vllm serve M"}')
    lacking = doctor(str(a), "--fleet", str(b))
    assert lacking.returncode == 2 and "lacks ['lmcache_server']" in lacking.stdout


def _doc_example() -> tuple[dict[str, Any], str]:
    text = (ROOT / "docs" / "doctor.md").read_text()
    inst = re.search(r"<!-- kvmux-fleet-instance -->\n```json\n(.*?)```", text, re.S)
    out = re.search(r"<!-- kvmux-fleet-output -->\n```text\n(.*?)```", text, re.S)
    assert inst is not None and out is not None, "docs/doctor.md lost its --fleet example"
    return json.loads(inst.group(1)), out.group(1)


def test_the_docs_example_passes_with_the_output_shown(tmp_path: Path):
    a, shown = _doc_example()
    (tmp_path / "node-a.json").write_text(json.dumps(a))
    (tmp_path / "node-b.json").write_text(json.dumps({**a, "name": "B", "host": "node-b"}))
    proc = doctor(str(tmp_path / "node-a.json"), "--fleet", str(tmp_path / "node-b.json"))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
    assert proc.stdout == shown
    js = doctor(str(tmp_path / "node-a.json"), "--fleet", str(tmp_path / "node-b.json"), "--json")
    assert js.returncode == 0, js.stdout + js.stderr[-2000:]
    rep = json.loads(js.stdout)
    assert rep["ok"] and rep["problems"] == [] and rep["warnings"] == []
    assert [i["label"] for i in rep["instances"]] == ["A", "B"]
    assert rep["instances"][1]["host"] == "node-b"
    assert rep["instances"][0]["report"]["connector"] == "KvmuxConnector"
