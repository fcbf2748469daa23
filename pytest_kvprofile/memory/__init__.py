"""The memory model: PyTorch's caching allocator (``allocator``), the simulated device and its ledger
(``device``), plain ``torch`` "cuda" calls served by it (``torch_mode``), and the engine's KV budget
arithmetic (``budget``)."""
