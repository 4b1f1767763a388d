"""The documentation's configuration blocks, read from README.md and docs/:
marked, parsed, accepted by ``doctor`` and run through vLLM's scheduler."""
