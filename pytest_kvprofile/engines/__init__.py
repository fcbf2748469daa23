"""Engine adapters: a real serving engine's own attention metadata builders, driven by the harness.

Why a separate package: these backends run an engine's released code unmodified (vLLM's
``FlashInferMetadataBuilder``), so they need the engine installed and a few stand-ins for what a CPU-only
machine lacks. What any engine's adapter needs is engine-free (``adapter.py``, ``batches.py``; docs/engines.md);
``vllm_*.py`` is vLLM's own. Nothing here imports the engine at module import; ``make_builders`` does (docs/vllm.md).
"""
