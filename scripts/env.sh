#!/usr/bin/env bash
# Make (once) and refresh the cached Python environment kvmux runs and tests
# in, build kvmux into it, and print its path.
#
#   scripts/env.sh [vllm-0.33]
#
# The environment lives outside the clone, in ${KVMUX_CACHE_DIR:-~/.cache/kvmux},
# so later runs and later clones reuse it. It is rebuilt only when its
# requirements file changes. The Rust build cache lives there too.
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
name=${1:-vllm-0.33}
req="$root/requirements/$name.txt"
[[ -f $req ]] || { echo "kvmux: no requirements file $req" >&2; exit 2; }

cache=${KVMUX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmux}
venv="$cache/venv-$name"
mkdir -p "$cache"

# One setup at a time per environment (CI and a developer may overlap).
exec 9>"$cache/.lock-$name"
flock 9

want=$(sha256sum "$req" | cut -d' ' -f1)
if [[ ! -x $venv/bin/python || "$(cat "$venv/.kvmux-req-sha" 2>/dev/null)" != "$want" ]]; then
    echo "kvmux: preparing $venv from $(basename "$req") (first run: several GB, a few minutes)" >&2
    [[ -x $venv/bin/python ]] || python3 -m venv "$venv"
    # PyPI only: ignore any machine-local wheel folder pip may be pointed at.
    PIP_FIND_LINKS= PIP_DISABLE_PIP_VERSION_CHECK=1 \
        "$venv/bin/pip" install --progress-bar off -q -r "$req" >&2
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
