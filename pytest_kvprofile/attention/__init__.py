"""FlashInfer's home in this package: everything that knows how FlashInfer plans, carves and computes attention.

| module | what it is |
|---|---|
| `facts` | FlashInfer's and the engines' fixed sizes (the 8 MiB int workspace, the default float workspaces) |
| `planner` | FlashInfer's planners ported to Python (the sizing model's closed forms read it) |
| `oracle_build` | FlashInfer's own `scheduler.cuh` compiled for the host (`csrc/`): cache, lock, digest |
| `oracle` | that build bound with ctypes: the exact bytes one `plan()` carves |
| `host_plan` | the host modules `simulated_gpu` hands FlashInfer's loaders (`plan`, `run`), and `observe_plans`, which tells the lifecycle driver which wrapper route planned into which workspace (torch mode's wrapper recognition) |
| `reference` | the float32 paged attention both tiers compare against (`attend`), paged layouts and test data |
| `wrappers` | every call the GPU tier makes into FlashInfer (wrappers, `plan()`/`run()` arguments, a captured decode) |

It sits right above `matrix` (the GPU catalog) and below everything else: `sizing` builds its requirement on it,
`memory` serves FlashInfer's loaders from it, the real-wrapper builders (`builtin/flashinfer_real.py`) plan through
it on both tiers. ``flashinfer`` and ``torch`` are imported inside functions only.
"""  # noqa: E501 - markdown table rows cannot wrap
