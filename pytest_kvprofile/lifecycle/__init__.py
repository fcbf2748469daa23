"""The reference engine lifecycle: phases, the driver that runs a backend through them, the record it
keeps, and the fault-injection probes.

| module | what it defines |
|---|---|
| `phases` | phase names and their order |
| `record` | `LifecycleResult` and its typed parts (phase, lease, call, error records; the probe target) |
| `driver` | `run_lifecycle`, `make_device`: one backend on one case on one device |
| `probes` | the warmup-retry probe (fresh builders, an OOM injected at each warmup allocation) |
| `parts` | `model_parts`: a backend's builders, then its resources (its own, or the case's) |
| `resources` | the resource kinds a matrix names (`RESOURCE_KINDS`: the correct DMA output workspace) |
"""
