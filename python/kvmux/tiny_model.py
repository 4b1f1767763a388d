"""A tiny random-weight Llama with a locally trained BPE tokenizer, built once
into a cache folder: a real model vLLM serves on the CPU in seconds, with
nothing downloaded from a hub.

Shape (what vLLM's CPU attention backend accepts): hidden 128, 2 layers,
4 attention heads of size 32, 2 KV heads, vocab 1024. Weights are seeded, so
every build is the same model. Needs ``torch``, ``transformers`` and
``tokenizers`` (all in vLLM's requirements).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

__all__ = ["BUILD", "cache_root", "tiny_llama"]

#: Bump when the model or tokenizer recipe changes: the folder name holds it.
BUILD = 1
VOCAB = 1024
SPECIALS = ["<unk>", "<s>", "</s>"]


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


def _build(path: Path) -> None:
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

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


def tiny_llama(root: Path | None = None) -> Path:
    """The model folder (built on first use; later calls return at once)."""
    root = cache_root() if root is None else root
    path = root / f"tiny-llama-b{BUILD}"
    if (path / "config.json").is_file() and (path / "tokenizer.json").is_file():
        return path
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-llama-", dir=root))
    try:
        _build(tmp)
        try:
            tmp.rename(path)  # atomic: a concurrent builder's folder is as good
        except OSError:
            if not (path / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return path
