#!/usr/bin/env bash
# Run every kvmux test: Rust (core, no Python), lint, and the Python suite
# against vLLM's real classes. Sets up what it needs on a fresh machine.
#
#   scripts/test.sh [extra pytest args]
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"
cache=${KVMUX_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvmux}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$cache/target}

echo "== Rust: fmt, clippy, tests (core without Python)"
cargo fmt --check
cargo clippy --all-targets --no-default-features -q -- -D warnings
cargo clippy --all-targets -q -- -D warnings
cargo test --no-default-features -q 2>&1 | grep -E "^(test result|failures|---- )|panicked" || true
cargo test --no-default-features -q >/dev/null

echo "== Python environment (vLLM 0.33)"
venv=$(scripts/env.sh vllm-0.33)

echo "== Python: ruff"
"$venv/bin/ruff" check python tests benches
"$venv/bin/ruff" format --check python tests benches

echo "== Python: pytest"
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider "$@"
rc=$?
set -e
if [[ $rc -eq 5 ]]; then
    echo "kvmux: pytest collected no tests: that is a failure" >&2
    exit 1
fi
exit $rc
