"""kvmux's development benchmarks, run from the repository root of a source
checkout (not in the wheel): the overhead comparisons against vLLM's
``MultiConnector`` and other rivals (``python -m benches.overhead``), the
scripts that split P1 and P1h by hook, the GPU check of the host tier's copy
path, and the core's criterion benches (``core.rs``). Results:
``benches/RESULTS.md``."""
