"""The tests' tiny hybrid model: Gemma 3's architecture (``Gemma3ForCausalLM``)
with the tiny Llama's shape (:data:`kvmux.bench.tiny_model.LLAMA`: hidden 128,
4 attention heads of size 32, 2 KV heads, vocab 1024) and 4 layers
alternating a 64-token sliding window and full attention: with vLLM's hybrid
KV cache manager on, two KV cache groups (sliding window, full attention) of
two layers each, overlaid on one allocation. Built once, with the demo's
tokenizer, into the same cache root (:func:`kvmux.bench.tiny_model.cached`).
"""

from __future__ import annotations

from pathlib import Path

from kvmux.bench.tiny_model import LLAMA, cached, train_tokenizer

__all__ = ["GEMMA3_LAYERS", "GEMMA3_WINDOW", "tiny_gemma3"]

#: The tiny Gemma 3's layers and sliding window (tokens).
GEMMA3_LAYERS = ("sliding_attention", "full_attention", "sliding_attention", "full_attention")
GEMMA3_WINDOW = 64


def _build(path: Path) -> None:
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    fast = train_tokenizer(path)
    cfg = Gemma3TextConfig(
        **{**LLAMA, "num_hidden_layers": len(GEMMA3_LAYERS)},
        query_pre_attn_scalar=32,
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


def tiny_gemma3(root: Path | None = None) -> Path:
    """The tiny hybrid Gemma 3's folder (built on first use)."""
    return cached("tiny-gemma3", _build, root)
