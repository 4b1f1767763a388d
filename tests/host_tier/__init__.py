"""The host tier (``KvmuxHostCache``) through vLLM's real scheduler and
real CPU tensors: its index, copies, chunked prefills, hybrid models and
vLLM 0.34's changes, alone and as a child of vLLM's ``MultiConnector``."""
