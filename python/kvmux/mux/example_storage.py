"""One folder per model for vLLM's ``ExampleConnector`` under kvmux.

vLLM's ``ExampleConnector`` stores KV in files under its
``shared_storage_path``: one folder per prompt, named by a hash of the
prompt's token ids (and multimodal hashes) alone, one file per layer name
(``vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py``,
``_generate_foldername_debug``). Nothing in that key names the model: a
second model pointed at the same path (a config copied from the README) would
find the first one's folder for the same tokens and load KV it did not
compute, silently when the shapes agree (two fine-tunes of one base model).

So kvmux hands each ``ExampleConnector`` child (and any subclass) the folder
``<shared_storage_path>/kvmux-<model>-<digest>``: the digest covers what
decides the KV bytes (the model, its revision, dtype, KV cache dtype and the
tensor-parallel size). Servers of the same model still share their files, as
the path is meant for; another model never sees them. A ``kvmux-model.json``
in the folder says which model it belongs to.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import re
import tempfile
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig

__all__ = [
    "DEFAULT_PATH",
    "MARKER",
    "is_example_connector",
    "model_folder",
    "model_identity",
    "per_model_transfer_config",
    "write_marker",
]

logger = logging.getLogger("kvmux")

#: ``ExampleConnector``'s ``shared_storage_path`` when none is given.
DEFAULT_PATH = "/tmp"
#: The file in each model's folder that names the model.
MARKER = "kvmux-model.json"
_KEY = "shared_storage_path"


def is_example_connector(cls: type) -> bool:
    """Whether ``cls`` is vLLM's ``ExampleConnector`` (or a subclass)."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import (
            ExampleConnector,
        )
    except ImportError:  # a vLLM without it: no child can be one
        return False
    return isinstance(cls, type) and issubclass(cls, ExampleConnector)


def model_identity(vllm_config: VllmConfig) -> dict[str, Any]:
    """What decides the KV bytes a model's engine writes: the model (its name
    or path, as vLLM was given it), revision, dtype, KV cache dtype and
    tensor-parallel size."""
    model = getattr(vllm_config, "model_config", None)
    cache = getattr(vllm_config, "cache_config", None)
    parallel = getattr(vllm_config, "parallel_config", None)
    return {
        "model": str(getattr(model, "model", None)),
        "revision": getattr(model, "revision", None),
        "dtype": str(getattr(model, "dtype", None)),
        "kv_cache_dtype": str(getattr(cache, "cache_dtype", None)),
        "tensor_parallel_size": int(getattr(parallel, "tensor_parallel_size", 1) or 1),
    }


def model_folder(root: str, identity: dict[str, Any]) -> str:
    """``root/kvmux-<model's last path part>-<digest of identity>``."""
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    name = os.path.basename(str(identity.get("model", "")).rstrip("/")) or "model"
    slug = re.sub(r"[^A-Za-z0-9._-]+", "-", name)[:48].strip("-.") or "model"
    return os.path.join(root, f"kvmux-{slug}-{digest}")


def per_model_transfer_config(
    cls: type, transfer_config: KVTransferConfig, vllm_config: VllmConfig
) -> KVTransferConfig:
    """``transfer_config`` as the child gets it: for an ``ExampleConnector``
    a copy whose ``shared_storage_path`` is this model's folder under the
    configured one (:func:`model_folder`); any other child's unchanged."""
    if not is_example_connector(cls):
        return transfer_config
    extra = dict(transfer_config.kv_connector_extra_config or {})
    root = str(extra.get(_KEY) or DEFAULT_PATH)
    extra[_KEY] = model_folder(root, model_identity(vllm_config))
    out = copy.copy(transfer_config)
    out.kv_connector_extra_config = extra
    return out


def write_marker(folder: str, identity: dict[str, Any]) -> None:
    """Create ``folder`` with its :data:`MARKER` (once; atomically). A folder
    kvmux cannot write is left to the child, which reports it when it saves;
    the marker is a note for people, not what keeps the models apart."""
    path = os.path.join(folder, MARKER)
    try:
        os.makedirs(folder, exist_ok=True)
        if os.path.exists(path):
            return
        fd, tmp = tempfile.mkstemp(prefix=".kvmux-model-", dir=folder)
        with os.fdopen(fd, "w") as f:
            json.dump(identity, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("kvmux: could not write %s: %s", path, e)
        return
    logger.info(
        "kvmux: ExampleConnector's files for %s go to %s (one folder per model: its "
        "files are named by the prompt's tokens alone)",
        identity.get("model"),
        folder,
    )
