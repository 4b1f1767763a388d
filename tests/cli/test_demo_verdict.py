"""The demo's verdict (``kvmux.cli.demo.Verdict``) says what was measured and
claims no speed-up it did not see; its exit status is correctness alone. With
real numbers: issue 46's busy machine (pass 2's TTFT p50 1,071 ms against
pass 1's 846 ms, 8/8 identical) and a run where the host tier made pass 2
14x faster; and the whole demo printout (``demo._run``) over a stand-in
engine whose pass 2 is slow. No vLLM engine is started."""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

from kvmux.cli import demo
from kvmux.cli.demo import Verdict
from kvmux.cli.engine import PassResult, Workload

CORRECT: dict[str, Any] = {
    "prompts": 8,
    "identical": 8,
    "host_tokens": 1024,
    "extra_tokens": 1024,
    "wiped": True,
}


def test_a_slow_pass_2_is_reported_not_faster_and_still_correct():
    v = Verdict(**CORRECT, ttft_pass1=0.846, ttft_pass2=1.071)
    lines = v.lines()
    assert v.ok and not v.faster
    assert "TTFT p50, pass 2 vs pass 1: 1071ms vs 846ms = 1.27x" in lines
    assert lines[-1] == (
        "OK: outputs identical, the host tier served; pass 2 not faster on this run "
        "(1.27x pass 1's TTFT: machine busy?)"
    )
    assert not any("faster (" in line for line in lines)


def test_a_fast_pass_2_is_reported_faster_with_its_ratio():
    v = Verdict(**CORRECT, ttft_pass1=6.347, ttft_pass2=0.452)
    assert v.ok and v.faster
    assert "outputs identical, pass 1 (computed) vs pass 2 (host tier): 8/8" in v.lines()
    assert "host tier served 1024 tokens in pass 2 (num_extra_cached_tokens: 1024)" in v.lines()
    assert v.lines()[-1] == (
        "OK: outputs identical, the host tier served; pass 2 faster (0.07x pass 1's TTFT)"
    )


def test_barely_faster_is_not_called_faster():
    v = Verdict(**CORRECT, ttft_pass1=1.000, ttft_pass2=0.950)
    assert v.ok and not v.faster
    assert "not faster on this run (0.95x" in v.lines()[-1]


def test_the_exit_status_is_correctness_whatever_the_speed():
    fast = {"ttft_pass1": 6.347, "ttft_pass2": 0.452}
    cases = [
        ({"identical": 7}, "1 output(s) differ"),
        ({"host_tokens": 0, "extra_tokens": 0}, "the host tier served nothing"),
        ({"extra_tokens": 512}, "differ from num_extra_cached_tokens"),
        ({"wiped": False}, "prefix cache was not wiped"),
    ]
    for change, why in cases:
        v = Verdict(**{**CORRECT, **change}, **fast)
        assert not v.ok
        assert v.lines()[-1].startswith("FAILED: ") and why in v.lines()[-1]
        assert "pass 2 faster" in v.lines()[-1]  # the speed is still reported as measured
    v = Verdict(**CORRECT, ttft_pass1=None, ttft_pass2=None)
    assert v.ok and v.lines()[-1].endswith("speed not measured")


class _Engine:
    """``kvmux.cli.engine`` with the engine stood in: pass 1 computes, pass 2
    loads 128 tokens per prefix from the host tier, is token-identical, and
    is slower (a busy machine)."""

    Workload = Workload

    def __init__(self, ttft1: float, ttft2: float) -> None:
        self.ttfts = [ttft1, ttft2]

    def demo_config(self, storage: str, capacity_gib: float) -> dict[str, Any]:
        from kvmux.cli.engine import demo_config

        return demo_config(storage, capacity_gib)

    def make_llm(self, *args: Any, **kwargs: Any) -> Any:
        return SimpleNamespace(reset_prefix_cache=lambda: True)

    def run_pass(self, llm: Any, prompts: list[list[int]], max_tokens: int, ask: Any) -> Any:
        second = len(self.ttfts) == 1
        ttft = self.ttfts.pop(0)
        n = len(prompts)
        loaded = [128, 128] + [0] * (n - 2) if second else [0] * n
        return PassResult(
            seconds=ttft * 2,
            token_ids=[[5, 6, 7]] * n,
            texts=["x"] * n,
            num_cached_tokens=[128] * n if second else [0] * n,
            kv_transfer_params=[
                {"num_extra_cached_tokens": k, "host_cache_stats": {"loaded_tokens": k}}
                for k in loaded
            ],
            ttft=[ttft] * n,
        )


def _demo(capsys, ttft1: float, ttft2: float) -> tuple[int, list[str]]:
    args = argparse.Namespace(host_gib=0.05, multiprocess=False)
    work = Workload(num_prompts=4, num_prefixes=2, prefix_blocks=4, max_tokens=3)
    rc = demo._run(_Engine(ttft1, ttft2), work, "model", "/tmp/unused", args)  # type: ignore[arg-type]
    return rc, capsys.readouterr().out.rstrip().splitlines()


def test_the_demo_prints_a_slow_pass_2_as_measured_and_exits_0(capsys):
    rc, lines = _demo(capsys, 0.846, 1.071)
    assert rc == 0
    assert "outputs identical, pass 1 (computed) vs pass 2 (host tier): 4/4" in lines
    assert "host tier served 256 tokens in pass 2 (num_extra_cached_tokens: 256)" in lines
    assert "TTFT p50, pass 2 vs pass 1: 1071ms vs 846ms = 1.27x" in lines
    assert lines[-1].startswith("OK: ") and "not faster on this run" in lines[-1]


def test_the_demo_prints_a_fast_pass_2_as_faster(capsys):
    rc, lines = _demo(capsys, 1.485, 0.100)
    assert rc == 0
    assert lines[-1].endswith("pass 2 faster (0.07x pass 1's TTFT)")
