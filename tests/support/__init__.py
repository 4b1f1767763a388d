"""What the tests share: vLLM's real scheduler in one process with a stand-in
model (harness), scripted and event-publishing children, the real LMCache
server as a fixture, the documentation's configuration blocks, a delaying
proxy for fault tests, the model-free demo. Not part of the wheel."""
