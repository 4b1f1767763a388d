#!/usr/bin/env bash
# kvmux's main job: set up what it needs (once) and run the demo.
#   scripts/demo.sh [demo options, see: python -m kvmux demo --help]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/env.sh" vllm-0.33)
cd "$root"
exec "$venv/bin/python" -m kvmux demo "$@"
