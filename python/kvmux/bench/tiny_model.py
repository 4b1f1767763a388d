"""The tiny random-weight Llamas the demo and the serving benchmarks serve,
with a locally trained BPE tokenizer, built once into kvmux's cache folder:
real models vLLM serves on the CPU in seconds, with nothing downloaded from
a hub. (Here, under ``kvmux.bench``, so that the command line imports the
benchmarks and never the other way round.)

One recipe (:data:`LLAMA`, the model's shape: what vLLM's CPU attention
backend accepts), one cache root (:func:`cache_root`), two forms:

- :func:`tiny_llama`: the model (weights and tokenizer), for an engine;
- :func:`tiny_llama_config`: its ``config.json`` alone, enough for vLLM's
  ``ModelConfig`` where no model runs (the scheduler simulator of the tests
  and the overhead benchmarks, ``tests/support/sim.py`` in a source
  checkout).

Weights are seeded, so every build is the same model. Building needs
``torch``, ``transformers`` and ``tokenizers`` (all in vLLM's requirements).
:func:`train_tokenizer` and :func:`cached` build other tiny models the same
way (the tests' hybrid Gemma 3).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = [
    "BUILD",
    "LLAMA",
    "VOCAB",
    "PAYS_LLAMA",
    "SERVE_LLAMA",
    "bench_model",
    "cache_root",
    "cached",
    "pays_llama",
    "serve_llama",
    "tiny_llama",
    "tiny_llama_config",
    "train_tokenizer",
]

#: Bump when the model or tokenizer recipe changes: the folder name holds it.
BUILD = 1
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]
#: The tiny Llama's shape: hidden 128, 2 layers, 4 attention heads of size
#: 32, 2 KV heads.
LLAMA: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}


def cache_root() -> Path:
    """``$KVMUX_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvmux`` (``~/.cache/kvmux``)."""
    env = os.environ.get("KVMUX_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "kvmux"


def _corpus(n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Pseudo-words from syllables: enough structure for BPE merges."""
    rng = random.Random(seed)
    syll = [a + b for a in "bcdfghklmnprstvz" for b in "aeiou"]
    words = ["".join(rng.choices(syll, k=rng.randint(1, 4))) for _ in range(3000)]
    return [" ".join(rng.choices(words, k=12)) for _ in range(n_lines)]


def train_tokenizer(path: Path) -> Any:
    """Train the BPE tokenizer on a synthetic corpus and save it into ``path``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )
    fast.save_pretrained(path)
    return fast


#: The serving benchmark's Llama (``python -m kvmux bench serve``): big enough
#: that prefill is the cost (a 2k-token prefix takes hundreds of ms on two
#: CPU cores), 8 KiB of float32 KV per token (8 layers, 2 KV heads of 64).
SERVE_LLAMA: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}

#: The benchmarks' "pays" model (``--workload pays``): a prefix costs far
#: more to recompute than to load. Wide (hidden 1024, MLP 4096, 16 heads of
#: 64) for about 120 M parameters, so about 0.24 GFLOP per token, but 2 KV
#: heads: the same 8 KiB of float32 KV per token as :data:`SERVE_LLAMA`.
#: On two CPU cores a token costs milliseconds to compute and a
#: microsecond or two to copy.
PAYS_LLAMA: dict[str, int] = {
    "vocab_size": VOCAB,
    "hidden_size": 1024,
    "intermediate_size": 4096,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


def _build(path: Path, shape: dict[str, int] | None = None) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = train_tokenizer(path)
    # Any: LlamaConfig's keywords are of many types, these ints among them.
    sizes: dict[str, Any] = LLAMA if shape is None else shape
    cfg = LlamaConfig(
        **sizes,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        # Larger than Llama's 0.02: decisive logits, so greedy decoding does
        # not hinge on float rounding between equally valid attention paths.
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    # Through the class: typeshed's functools.wraps (which PreTrainedModel.to
    # uses) types no binding to an instance, so model.to(...) does not check.
    model = LlamaForCausalLM.to(LlamaForCausalLM(cfg), torch.float32)
    model.save_pretrained(path)


def tiny_llama(root: Path | None = None) -> Path:
    """The tiny Llama's folder (built on first use; later calls return at once)."""
    return cached("tiny-llama", _build, root)


def serve_llama(root: Path | None = None) -> Path:
    """The serving benchmark's random Llama (:data:`SERVE_LLAMA`), built like
    :func:`tiny_llama` on first use."""
    shape = f"h{SERVE_LLAMA['hidden_size']}l{SERVE_LLAMA['num_hidden_layers']}"
    return cached(f"serve-llama-{shape}", lambda p: _build(p, SERVE_LLAMA), root)


def pays_llama(root: Path | None = None) -> Path:
    """The "pays" workload's random Llama (:data:`PAYS_LLAMA`), built like
    :func:`tiny_llama` on first use (about 0.5 GB of float32 weights)."""
    shape = f"h{PAYS_LLAMA['hidden_size']}l{PAYS_LLAMA['num_hidden_layers']}"
    return cached(f"pays-llama-{shape}", lambda p: _build(p, PAYS_LLAMA), root)


#: The benchmarks' models by name (``ServeWorkload.model``).
BENCH_MODELS: dict[str, Callable[[], Path]] = {
    "serve": lambda: serve_llama(),
    "pays": lambda: pays_llama(),
}


def bench_model(name: str) -> Path:
    """The folder of the benchmarks' model ``name`` ("serve" or "pays")."""
    return BENCH_MODELS[name]()


def cached(name: str, build: Callable[[Path], None], root: Path | None = None) -> Path:
    """``root/NAME-bBUILD`` (``root``: :func:`cache_root`), made by ``build``
    into a temporary folder on first use and renamed into place."""
    root = cache_root() if root is None else root
    path = root / f"{name}-b{BUILD}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
    try:
        build(tmp)
        try:
            tmp.rename(path)  # atomic: a concurrent builder's folder is as good
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path


def tiny_llama_config(root: str | os.PathLike[str] | None = None) -> Path:
    """A folder with only the tiny Llama's ``config.json`` (no weights, no
    tokenizer): enough for vLLM's ``ModelConfig``. ``root`` (default
    :func:`cache_root`) holds it; the folder's path is the model's name,
    which external caches such as LMCache put in their keys (a distinct
    root: distinct keys)."""
    root = cache_root() if root is None else Path(root)
    path = root / f"tiny-llama-config-b{BUILD}"
    path.mkdir(parents=True, exist_ok=True)
    cfg = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **LLAMA,
        "torch_dtype": "float32",
    }
    fd, tmp = tempfile.mkstemp(prefix=".config-", dir=path)
    with os.fdopen(fd, "w") as f:
        json.dump(cfg, f)
    os.replace(tmp, path / "config.json")  # atomic: a concurrent writer writes the same
    return path
