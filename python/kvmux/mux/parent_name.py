"""What vLLM decides from the parent connector's *name*, checked for kvmux.

vLLM's ``KVTransferConfig`` reads the children of a connector only when it is
named ``"MultiConnector"``: its KV roles (vLLM 0.34: ``is_kv_producer`` /
``is_kv_consumer``, which decide whether freeing a request's blocks is
deferred while a load may fill them and whether partial tails are
finalized), ``uses_custom_mem_pool`` (0.34: whether the extensible KV cache
may be used) and ``has_connector(name)`` (NIXL's checks, HiSparse,
``SimpleCPUOffloadConnector``'s CPU block count). Under the name
``KvmuxConnector`` it sees only the top level.

kvmux asks vLLM's own ``KVTransferConfig`` every one of those questions twice:
as configured, and as vLLM would answer for the same children under the name
``MultiConnector`` (each child as kvmux builds it, with the role it
inherits). Where the answers differ and the decision matters for this
engine, :func:`parent_name_problems` names the difference and the fix: the
key to set at the top level, or the ``MultiConnector`` name (kvmux exports
that name too, so ``{"kv_connector": "MultiConnector",
"kv_connector_module_path": "kvmux"}`` runs kvmux with vLLM reading the
children). The connector refuses to start with those problems
(:class:`~kvmux.errors.KvmuxConfigError`), and ``python -m kvmux doctor``
reports them before start. Nothing here depends on a vLLM version: a
question a vLLM does not ask (0.33 reads only the top-level role under any
name) never differs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmux.mux.config import CUSTOM_MEM_POOL_KEY

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.config.kv_transfer import KVTransferConfig

    from kvmux.mux.config import MuxConfig

__all__ = ["as_multiconnector", "parent_name_problems"]

MULTI = "MultiConnector"
#: The other fix for every problem here.
MULTI_FIX = (
    f'or name the connector "{MULTI}" with kv_connector_module_path "kvmux" (kvmux runs '
    "the same; vLLM then reads the children itself)"
)
#: What each role pair means to vLLM, and the role that says it.
_ROLE_OF = {(True, True): "kv_both", (True, False): "kv_producer", (False, True): "kv_consumer"}
_NIXL = ("NixlConnector", "NixlPullConnector", "NixlPushConnector")


def _routed_experts(vllm_config: VllmConfig | None) -> bool:
    """``--enable-return-routed-experts`` (vLLM 0.34: ``aux_output_config``;
    before it, ``model_config``)."""
    if vllm_config is None:
        return False
    for holder in ("aux_output_config", "model_config"):
        if getattr(getattr(vllm_config, holder, None), "enable_return_routed_experts", False):
            return True
    return False


def _dcp(vllm_config: VllmConfig | None) -> int:
    if vllm_config is None:
        return 1
    return int(getattr(vllm_config.parallel_config, "decode_context_parallel_size", 1) or 1)


def _prefix_caching(vllm_config: VllmConfig | None) -> bool:
    if vllm_config is None:
        return True  # vLLM's default
    return bool(vllm_config.cache_config.enable_prefix_caching)


def _named_checks(vllm_config: VllmConfig | None) -> list[tuple[tuple[str, ...], str | None]]:
    """Each group of names vLLM looks for with ``has_connector``, and what it
    decides from it for this engine (None: nothing, with these settings)."""
    routed = _routed_experts(vllm_config)
    dcp = _dcp(vllm_config)
    return [
        (
            _NIXL,
            "that --enable-return-routed-experts is incompatible with NIXL"
            if routed
            else f"NIXL's decode-context-parallel checks (decode_context_parallel_size={dcp})"
            if dcp > 1
            else None,
        ),
        (
            ("MoRIIOConnector", "MooncakeConnector"),
            "that --enable-return-routed-experts is incompatible with it" if routed else None,
        ),
        (("HiSparseConnector",), "to turn HiSparse on and size its host pool"),
        (
            ("SimpleCPUOffloadConnector",),
            "to hand it its CPU block count after the KV cache is sized"
            if _prefix_caching(vllm_config)
            else None,
        ),
    ]


def as_multiconnector(ktc: KVTransferConfig, cfg: MuxConfig) -> KVTransferConfig:
    """The same config under the name ``MultiConnector``, each child entry as
    kvmux builds it (its role the one it inherits when it sets none)."""
    from vllm.config.kv_transfer import KVTransferConfig

    children = [
        {
            "kv_connector": s.transfer_config.kv_connector,
            "kv_role": s.transfer_config.kv_role,
            "kv_connector_extra_config": s.transfer_config.kv_connector_extra_config,
        }
        for s in cfg.children
    ]
    return KVTransferConfig(
        kv_connector=MULTI,
        kv_role=ktc.kv_role,
        engine_id=ktc.engine_id,
        kv_buffer_device=ktc.kv_buffer_device,
        kv_connector_extra_config={**ktc.kv_connector_extra_config, "connectors": children},
    )


def _roles(producer: bool, consumer: bool) -> str:
    parts = [p for p, on in (("a KV producer", producer), ("a KV consumer", consumer)) if on]
    return " and ".join(parts) or "neither a KV producer nor a consumer"


def parent_name_problems(
    ktc: KVTransferConfig, cfg: MuxConfig, vllm_config: VllmConfig | None = None
) -> list[str]:
    """Every decision vLLM takes from this config that would differ under the
    name ``MultiConnector`` and matters for this engine (``vllm_config``;
    None: vLLM's defaults), each with its fix. Empty under the name
    ``MultiConnector`` itself."""
    if ktc.kv_connector == MULTI:
        return []
    multi = as_multiconnector(ktc, cfg)
    problems: list[str] = []

    ours = (bool(ktc.is_kv_producer), bool(ktc.is_kv_consumer))
    theirs = (bool(multi.is_kv_producer), bool(multi.is_kv_consumer))
    if ours != theirs and theirs in _ROLE_OF:
        roles = ", ".join(f"{s.name} {s.transfer_config.kv_role}" for s in cfg.children)
        problems.append(
            f"the top-level kv_role {ktc.kv_role!r} makes vLLM treat this instance as "
            f"{_roles(*ours)}, but the children's roles ({roles}) make it {_roles(*theirs)}; "
            f'vLLM reads the children\'s roles only under the name "{MULTI}" (it decides from '
            "them whether to defer freeing blocks a load may still fill, and whether to "
            f'finish partial tails); set the top-level "kv_role" to {_ROLE_OF[theirs]!r}, '
            f"{MULTI_FIX}"
        )

    uses_pool = getattr(type(ktc), "uses_custom_mem_pool", None)  # vLLM 0.34's method
    if uses_pool is not None and uses_pool(multi) and not uses_pool(ktc):
        pooled = [
            s.name
            for s in cfg.children
            if s.transfer_config.kv_connector_extra_config.get(CUSTOM_MEM_POOL_KEY)
        ]
        problems.append(
            f"{pooled} allocate(s) the KV cache from its own memory pool "
            f"({CUSTOM_MEM_POOL_KEY}), which vLLM looks for only at the top level under "
            "this name (it must not use its extensible KV cache then); add "
            f'"{CUSTOM_MEM_POOL_KEY}": true to kvmux\'s own kv_connector_extra_config, '
            f"{MULTI_FIX}"
        )

    for names, decides in _named_checks(vllm_config):
        if decides is None:
            continue
        for s in cfg.children:
            name = s.transfer_config.kv_connector
            if name in names and multi.has_connector(name) and not ktc.has_connector(name):
                problems.append(
                    f"connector {s.name!r}: vLLM looks for {name} by name to decide {decides}, "
                    f'and finds it among the children only under the name "{MULTI}"; name the '
                    f'connector "{MULTI}" with kv_connector_module_path "kvmux" (kvmux runs the '
                    "same; vLLM then reads the children itself)"
                )
    return problems
