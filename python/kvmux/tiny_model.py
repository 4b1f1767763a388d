"""Tiny random-weight models with a locally trained BPE tokenizer, built once
into a cache folder: real models vLLM serves on the CPU in seconds, with
nothing downloaded from a hub.

- :func:`tiny_llama`: a plain model (one KV cache group). Shape (what vLLM's
  CPU attention backend accepts): hidden 128, 2 layers, 4 attention heads of
  size 32, 2 KV heads, vocab 1024.
- :func:`tiny_gemma3`: a hybrid model, Gemma 3's architecture
  (``Gemma3ForCausalLM``) with the same shape and 4 layers alternating a
  64-token sliding window and full attention: with vLLM's hybrid KV cache
  manager on, two KV cache groups (sliding window, full attention) of two
  layers each, overlaid on one allocation.

Weights are seeded, so every build is the same model. Needs ``torch``,
``transformers`` and ``tokenizers`` (all in vLLM's requirements).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["BUILD", "GEMMA3_LAYERS", "GEMMA3_WINDOW", "cache_root", "tiny_gemma3", "tiny_llama"]

#: Bump when the model or tokenizer recipe changes: the folder name holds it.
BUILD = 1
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]
#: The tiny Gemma 3's layers and sliding window (tokens).
GEMMA3_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
GEMMA3_WINDOW = 64


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


def _tokenizer(path: Path) -> Any:
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


def _build(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    fast = _tokenizer(path)
    cfg = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=1024,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
        # Larger than Llama's 0.02: decisive logits, so greedy decoding does
        # not hinge on float rounding between equally valid attention paths.
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)


def _build_gemma3(path: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fast = _tokenizer(path)
    cfg = Gemma3TextConfig(
        vocab_size=VOCAB,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=len(GEMMA3_LAYERS),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        query_pre_attn_scalar=32,
        max_position_embeddings=1024,
        sliding_window=GEMMA3_WINDOW,
        layer_types=list(GEMMA3_LAYERS),
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=0,
        # Untied, with wide weights: with Gemma's tied, scaled embeddings a
        # random model repeats its input token whatever the context; this
        # one's greedy output changes with a token anywhere in the prompt
        # (full attention) and with one inside the window (sliding window).
        tie_word_embeddings=False,
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg).to(torch.float32)
    model.save_pretrained(path)


def tiny_llama(root: Path | None = None) -> Path:
    """The tiny Llama's folder (built on first use; later calls return at once)."""
    return _cached("tiny-llama", _build, root)


def tiny_gemma3(root: Path | None = None) -> Path:
    """The tiny hybrid Gemma 3's folder (built on first use)."""
    return _cached("tiny-gemma3", _build_gemma3, root)


def _cached(name: str, build: Callable[[Path], None], root: Path | None) -> Path:
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
