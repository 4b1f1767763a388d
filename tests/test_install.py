"""The README's install line, run as written on a clean copy of the
repository (the files git tracks or would track: no ``target/``, no built
``_core``), into a new virtual environment: ``pip install .`` builds the Rust
core with maturin (pip fetches maturin for the build; ``cargo`` must be on
``PATH``) and installs the wheel. kvmux from that environment then imports
with its compiled core, and its connector classes are vLLM connectors (vLLM
from this test's environment, behind the new one's ``site-packages``).

Runs once, on vLLM 0.33 (the wheel does not depend on vLLM's version; the
0.34 run skips it). Cost, measured on 2 shared cores: 57 s with the Rust
dependencies built in ``CARGO_TARGET_DIR`` (``scripts/test.sh`` keeps it in
the cache folder), 63 s for ``pip wheel .`` with an empty one."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARKER = "<!-- kvmux-install -->"


def install_block(text: str) -> list[str]:
    """The commands of the README's install block (the ``bash`` block under
    :data:`MARKER`), comments dropped."""
    at = text.index(MARKER)
    m = re.compile(r"```bash\n(.*?)```", re.S).search(text, at)
    if m is None or text[at + len(MARKER) : m.start()].strip():
        raise AssertionError(f"{MARKER} is not followed by a bash block")
    lines = [line.split("#", 1)[0].strip() for line in m.group(1).splitlines()]
    return [line for line in lines if line]


def clean_copy(dest: Path) -> Path:
    """What a clone holds: the files git tracks, plus those not yet committed
    that it does not ignore; written now, as a clone's are (so cargo builds
    the crate from them rather than taking it for the one it built here)."""
    files = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    ).stdout.split(b"\0")
    for name in filter(None, files):
        src = ROOT / os.fsdecode(name)
        if src.is_file():  # a deleted file git still tracks is not copied
            (dest / os.fsdecode(name)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(src, dest / os.fsdecode(name))
    return dest


def test_the_readme_installs_with_pip_install_dot():
    text = (ROOT / "README.md").read_text()
    assert install_block(text) == ["pip install ."]
    assert "pip install kvmux" not in text  # not published: a line that finds nothing


def _vllm() -> str:
    try:
        return metadata.version("vllm")
    except metadata.PackageNotFoundError:
        return "none"


@pytest.mark.skipif(
    not _vllm().startswith("0.33"),
    reason="the install is checked once, in the vLLM 0.33 environment",
)
def test_the_readme_install_line_builds_and_installs_kvmux_from_a_clean_copy(tmp_path: Path):
    if shutil.which("cargo") is None:
        pytest.fail("cargo is not on PATH: pip install . needs a Rust toolchain")
    src = clean_copy(tmp_path / "kvmux")
    assert not list(src.rglob("*.so")) and not (src / "target").exists()
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    for line in install_block((ROOT / "README.md").read_text()):
        proc = subprocess.run(
            ["bash", "-c", line], cwd=src, env=env, capture_output=True, text=True, timeout=1500
        )
        assert proc.returncode == 0, f"{line}:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = subprocess.run(
        [str(venv / "bin" / "python"), "-c", purelib],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert (Path(site) / "kvmux" / "mux" / "connector.py").is_file()
    assert list((Path(site) / "kvmux").glob("_core*.so"))
    # This environment's vLLM behind the new kvmux: PYTHONPATH comes before
    # this environment's site-packages (where a development install may be).
    check = (
        "import kvmux, kvmux._core\n"
        "from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1\n"
        "assert issubclass(kvmux.KvmuxConnector, KVConnectorBase_V1)\n"
        "assert issubclass(kvmux.KvmuxHostCache, KVConnectorBase_V1)\n"
        "assert kvmux.MultiConnector is kvmux.KvmuxConnector\n"
        "print(kvmux.__file__, kvmux._core.__file__)\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = site
    proc = subprocess.run(
        [sys.executable, "-c", check],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    kvmux_file, core_file = proc.stdout.split()[-2:]
    assert kvmux_file.startswith(site) and core_file.startswith(site), proc.stdout
    assert sysconfig.get_path("purelib") != site
