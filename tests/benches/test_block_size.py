"""``python -m benches.overhead --block-size N`` (issue 33: vLLM 0.34's GPU default
block size is 64, was 16): P3 keys the same 32,768-token prompt at N in both
tiers, P4 copies N-token blocks, the same bytes per step; an invalid N is
refused. Behaviour only: no timing is asserted."""

from __future__ import annotations

import argparse
import json

import pytest

from benches.overhead import command, copies, lookup, runner


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    return parser


def test_p3_at_64_keys_the_same_prompt_in_512_blocks_in_both_tiers():
    case = lookup.build(quick=True, block_size=64)
    case.check()  # both tiers find the whole prompt: 512 x 64 = 32,768 tokens
    assert case.notes["blocks"] == 512 and case.notes["block_size"] == 64
    assert case.kvmux()[0] == case.rival()[0] == 32_768
    assert "512 blocks of 64" in case.title and "512 blocks of 64 tokens" in case.unit
    # The default stays 2,048 blocks of 16, as in the earlier results.
    assert lookup.build(quick=True).notes["blocks"] == 2048


def test_p4_at_64_copies_the_same_bytes_in_a_quarter_of_the_blocks():
    at16, at64 = copies.build(quick=True), copies.build(quick=True, block_size=64)
    at64.check()  # saved and loaded back unchanged
    assert at16.notes["step_blocks"] == 128 and at64.notes["step_blocks"] == 32
    assert at64.notes["bytes_each_way"] == at16.notes["bytes_each_way"]
    assert at64.notes["block_bytes_per_layer"] == 4 * at16.notes["block_bytes_per_layer"]
    assert "32 blocks of 64 tokens" in at64.unit and "64-token blocks" in at64.title


def test_bench_block_size_64_runs_p3_and_p4_and_says_so(tmp_path, capsys):
    out_json = tmp_path / "bench.json"
    args = _parser().parse_args(
        ["--only", "P3", "P4", "--quick", "--block-size", "64", "--repeats", "1"]
        + ["--warmup", "0", "--no-progress", "--json", str(out_json)]
    )
    assert command.run(args) == 0
    out = capsys.readouterr().out
    assert "P3: per op = lookup of 512 blocks of 64 tokens" in out
    assert "P4: per op = 32 blocks of 64 tokens" in out
    results = {r["key"]: r for r in json.loads(out_json.read_text())["results"]}
    assert results["P3"]["notes"]["blocks"] == 512
    assert results["P3"]["notes"]["block_size"] == results["P4"]["notes"]["block_size"] == 64


def test_only_p3_and_p4_get_the_block_size(monkeypatch):
    built: dict[str, dict] = {}

    def fake_import(name: str):
        key = next(k for k, m in runner.CASES.items() if m == name)

        class Module:
            @staticmethod
            def build(quick: bool, **kw):
                built[key] = kw
                raise StopIteration  # enough: the builder was called

        return Module

    monkeypatch.setattr(runner.importlib, "import_module", fake_import)
    for key in ("P1", "P2", "P3", "P4"):
        with pytest.raises(StopIteration):
            runner.run([key], quick=True, block_size=64)
    assert built == {"P1": {}, "P2": {}, "P3": {"block_size": 64}, "P4": {"block_size": 64}}


@pytest.mark.parametrize("bad", ["0", "-16", "24", "100"])
def test_bench_refuses_a_block_size_not_a_positive_multiple_of_16(bad):
    args = _parser().parse_args(["--only", "P3", "--block-size", bad])
    with pytest.raises(SystemExit, match=r"--block-size must be a positive multiple of 16"):
        command.run(args)
