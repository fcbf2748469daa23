"""The GPU tier: real CUDA devices, real FlashInfer wrappers, real CUDA graphs.

Nothing here imports torch.cuda, flashinfer or pynvml at module import time: the xdist controller
imports the plugin, and initializing CUDA there would hold a context on every GPU and break the
workers' device pinning. Heavy imports live inside the functions that need them.

Modules: ``topology`` (what GPUs there are, NVML + torch), ``pinning`` (one xdist worker per GPU),
``cuda_device`` (the Device interface on ``torch.cuda``), ``flashinfer_builders`` (real FlashInfer
builders and the reference attention), ``sizing_probe`` (plan() with exactly the oracle's bytes),
``matrix_gen`` (a one-GPU matrix for the detected device) and ``hooks`` (the pytest side).
"""
