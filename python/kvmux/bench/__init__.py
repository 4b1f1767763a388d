"""The benchmarks an operator runs against a vLLM of theirs
(``python -m kvmux bench serve``, ``python -m kvmux bench fleet``), and the
launchers they need:

- :mod:`~kvmux.bench.serve`: time to first token under prefix reuse, one real
  vLLM server per system (vLLM alone, the host tier, LMCache,
  ``MultiConnector``, kvmux), the same multi-round chat workload on each;
- :mod:`~kvmux.bench.fleet`: the same workload over two instances behind a
  round-robin router, LMCache's L2 on one shared Redis against L1 only;
- :mod:`~kvmux.bench.server` (a vLLM API server in its own process group),
  :mod:`~kvmux.bench.lmcache` (LMCache's MP server), :mod:`~kvmux.bench.redis`
  (a Redis server), each on loopback and stopped by its process group;
- :mod:`~kvmux.bench.tiny_model`: the tiny random-weight Llamas the demo and
  these benchmarks serve, built locally.

kvmux's own overhead comparisons (P1-P4, P1h, S1, C1, C1L against
``MultiConnector`` and other rivals, on vLLM's scheduler with the model stood
in) are development benchmarks, not in the wheel: ``python -m
benches.overhead`` from a source checkout (``benches/RESULTS.md``).
"""
