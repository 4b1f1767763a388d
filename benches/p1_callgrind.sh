#!/usr/bin/env bash
# P1's replays counted in instructions (callgrind), not seconds: repeatable
# whatever else the machine does, so two builds compare on a noisy VM.
#   benches/p1_callgrind.sh [kvmux|mc] [N=20]   (in the venv kvmux runs in)
# Prints the instructions of N replays of the 64 lifecycles; the setup
# (vLLM's import, the recording) runs uninstrumented.
set -euo pipefail
side=${1:-kvmux}
n=${2:-20}
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$root"  # benches.* and tests.* import from the repository root
work=$(mktemp -d)
flag=$work/flag
valgrind --tool=callgrind --instr-atstart=no --callgrind-out-file="$work/cg.out" \
    python -m benches.p1_callgrind_replay "$side" "$n" "$flag" >"$work/log" 2>&1 &
vg=$!
until [[ -e $flag.ready ]]; do
    kill -0 $vg 2>/dev/null || { cat "$work/log" >&2; exit 1; }
    sleep 1
done
callgrind_control -i on $vg >/dev/null 2>&1
touch "$flag.go"
until [[ -e $flag.done ]]; do sleep 0.5; done
callgrind_control -i off $vg >/dev/null 2>&1
touch "$flag.end"
wait $vg
total=$(callgrind_annotate "$work/cg.out" | awk '/PROGRAM TOTALS/ && !n {print $1; n=1}')
echo "P1 $side: $total instructions for $n replays ($work/cg.out)"
