"""P1h split by hook: runs the workload of ``python -m benches.overhead
--only P1h`` three times per side (kvmux and vLLM's MultiConnector over one
``KvmuxHostCache``) and prints the time spent in each hook vLLM's scheduler
calls (outermost calls only), in ms per run. Run from the repository root:
python -m benches.p1h_per_hook"""

from __future__ import annotations

from benches.overhead import host_lifecycle as hl

RUNS = 3


def per_hook(name: str, module: str | None, prompts: list[list[int]]) -> dict[str, float]:
    side = hl.Lifecycles(hl._ktc(name, module), prompts)
    for _ in range(RUNS):
        side()
    return {hook: s / RUNS * 1e3 for hook, s in side.per_hook.items()}


def main() -> None:
    prompts = hl.workload(1024)
    kv = per_hook("KvmuxConnector", "kvmux", prompts)
    mc = per_hook("MultiConnector", None, prompts)
    print(f"{'hook':34s} {'kvmux ms':>9s} {'MultiConnector ms':>18s}")
    for hook in sorted(kv, key=lambda h: -kv[h]):
        print(f"{hook:34s} {kv[hook]:9.2f} {mc.get(hook, 0.0):18.2f}")


if __name__ == "__main__":
    main()
