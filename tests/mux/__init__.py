"""The multiplexer (``KvmuxConnector``) through vLLM's real scheduler and
workers: its contract, load policies, deadlines, breakers, faults,
completions, stats and events, with scripted children and real ones (the
host tier, LMCache)."""
