"""The end-to-end suite's tagging child (``tagging_connector.py``) declaring
support for vLLM's hybrid KV cache manager, so that a hybrid model runs
under ``KvmuxConnector`` with HMA on: it moves no KV, and answers
``request_finished_all_groups`` with its tags, as the plain one answers
``request_finished``."""

from __future__ import annotations

from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA

from tests.e2e.tagging_connector import TaggingConnector


class HMATaggingConnector(TaggingConnector, SupportsHMA):
    def request_finished_all_groups(self, request: Any, block_ids: tuple[list[int], ...]):
        return False, {
            "tagged_by": "HMATaggingConnector",
            "prompt_tokens": request.num_prompt_tokens,
            "kv_cache_groups": len(block_ids),
        }
