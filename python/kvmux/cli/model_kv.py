"""What a local model's KV cache will look like to the connectors, read from
its ``config.json`` alone, without starting vLLM or loading weights.

vLLM builds one KV cache group per kind of attention layer (more when the
counts of the kinds differ): a plain model, whose layers are all full
attention or all the same sliding window, has one group; a hybrid model
(sliding-window or chunked-local layers beside full attention, or
state-space / linear-attention layers) has several. ``doctor --model`` uses
this to say whether a configuration starts for that model. The layer kinds
are read from the fields Hugging Face configs use for them; a config that
names none of them is a plain model.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["ModelKV", "read_model_kv"]

FULL = "full_attention"
SLIDING = "sliding_attention"
CHUNKED = "chunked_attention"
STATE = "state_space"
#: layer kinds vLLM cannot run without the hybrid KV cache manager
NEEDS_HMA = (STATE,)

# Hugging Face's names for layer kinds (layer_types, layers_block_type, ...).
_KIND = {
    "full_attention": FULL,
    "attention": FULL,
    "global": FULL,
    "sliding_attention": SLIDING,
    "sliding_window": SLIDING,
    "local": SLIDING,
    "chunked_attention": CHUNKED,
    "linear_attention": STATE,
    "mamba": STATE,
    "mamba2": STATE,
    "hybrid": STATE,
    "conv": STATE,
    "short_conv": STATE,
    "recurrent": STATE,
    "rwkv": STATE,
}


@dataclass(frozen=True)
class ModelKV:
    """The model's layers by kind, and what that means for KV cache groups."""

    path: str
    architecture: str
    layers: dict[str, int]
    """Layer kind -> number of layers (full_attention, sliding_attention,
    chunked_attention, state_space)."""

    @property
    def hybrid(self) -> bool:
        """More than one kind of layer: more than one KV cache group."""
        return len(self.layers) > 1

    @property
    def needs_hma(self) -> bool:
        """vLLM cannot run this model with the hybrid KV cache manager off."""
        return any(k in self.layers for k in NEEDS_HMA) and len(self.layers) > 1

    def describe(self) -> str:
        kinds = ", ".join(f"{n} {k}" for k, n in self.layers.items())
        groups = "several KV cache groups (hybrid)" if self.hybrid else "one KV cache group"
        return f"{self.architecture}: {kinds} layers -> {groups}"


def read_model_kv(path: str | Path) -> ModelKV:
    """Read ``path/config.json``. Raises ``OSError`` or ``ValueError`` with a
    message saying what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise OSError(
            f"{str(folder)!r} is not a folder; give a local model folder with config.json"
        )
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise OSError(f"{str(folder)!r} has no config.json; give a local model folder")
    cfg = json.loads(cfg_file.read_text())
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file} is not a JSON object")
    inner = cfg.get("text_config")
    text: dict[str, Any] = inner if isinstance(inner, dict) else cfg
    arch = (cfg.get("architectures") or [cfg.get("model_type", "unknown model")])[0]
    n = text.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"{cfg_file} has no num_hidden_layers; is it a decoder model?")
    return ModelKV(str(folder), str(arch), dict(Counter(_layer_kinds(text, n))))


def _layer_kinds(c: dict[str, Any], n: int) -> list[str]:
    for key in ("layer_types", "layers_block_type", "block_types"):
        kinds = c.get(key)
        if isinstance(kinds, list) and kinds:
            return [_KIND.get(str(k).lower(), str(k).lower()) for k in kinds[:n]]
    pattern = c.get("hybrid_override_pattern")  # NemotronH: "M" mamba, "*" attention
    if isinstance(pattern, str) and pattern:
        return [STATE if ch == "M" else FULL for ch in pattern if ch in "M*"]
    period = c.get("attn_layer_period")  # Jamba: attention every `period` layers
    if isinstance(period, int) and period > 0:
        offset = int(c.get("attn_layer_offset", 0))
        return [FULL if i % period == offset else STATE for i in range(n)]
    if isinstance(c.get("attention_chunk_size"), int):  # Llama 4: chunked local + global
        rope = c.get("no_rope_layers")  # 1: a RoPE (chunked) layer, 0: a global one
        if isinstance(rope, list) and len(rope) >= n:
            return [CHUNKED if rope[i] else FULL for i in range(n)]
        return [FULL if (i + 1) % 4 == 0 else CHUNKED for i in range(n)]
    window = c.get("sliding_window")
    if window:
        every = c.get("sliding_window_pattern")  # Gemma 2/3: every `every`-th layer global
        if isinstance(every, int) and every > 1:
            return [FULL if (i + 1) % every == 0 else SLIDING for i in range(n)]
        if c.get("use_sliding_window") is False:
            return [FULL] * n
        upto = c.get("max_window_layers")  # Qwen 2: layers from max_window_layers slide
        if c.get("use_sliding_window") and isinstance(upto, int) and 0 < upto < n:
            return [FULL if i < upto else SLIDING for i in range(n)]
        return [SLIDING] * n
    return [FULL] * n
