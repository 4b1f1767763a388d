"""The benchmarks' own behaviour (their flags, what each case builds): no
timing is asserted."""
