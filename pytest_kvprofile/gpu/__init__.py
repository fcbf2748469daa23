"""The GPU tier: real CUDA devices, real FlashInfer wrappers, real CUDA graphs.

Nothing here imports torch.cuda, flashinfer or pynvml at module import time: the xdist controller
imports the plugin, and initializing CUDA there would hold a context on every GPU and break the
workers' device pinning. Heavy imports live inside the functions that need them.

Modules: ``topology`` (what GPUs there are, NVML + torch), ``pinning`` (one xdist worker per GPU),
``selection`` (which matrix cases fit the GPU under test), ``cuda_device`` (the Device interface on
``torch.cuda``), ``sizing_probe`` (plan() with exactly the oracle's bytes), ``matrix_gen`` (a one-GPU matrix
for the detected device). The pytest side is ``pytest_kvprofile.plugin.gpu``; the tests are
``pytest_kvprofile.gpu_suite`` (one home per layer: library, pytest wiring, test modules).
The float32 reference and every call into FlashInfer are FlashInfer's (``pytest_kvprofile.attention``);
the real-wrapper builders are the built-in
``flashinfer`` backend's (``pytest_kvprofile.builtin.flashinfer_real``), one for both tiers.
"""
