"""The contract a backend opts in to: support declaration, lease, shared arena, builder protocol.

| module | what it defines |
|---|---|
| `support` | `ProfilingSupport` (REQUIRED / NEUTRAL / UNSUPPORTED), the fail-closed resolver |
| `lease` | `Lease`: keeps persistent memory alive from the reservation to its release |
| `workspace` | `WorkspaceManager`, `ArenaView`: one float arena per micro-batch, locked after warmup |
| `protocol` | the builder protocol, `BuilderContext`/`BuilderHost`, `WorkspaceDeclaration`, `BoundWorkspace`, `Batch` |
| `resources` | persistent owners that are not builders (`PersistentResource`), adapted to the builder protocol |
| `backends` | `Backend` (a named builder factory) and `EnginePolicy` |
| `budget` | the engine's KV budget as terms between lifecycle snapshots (`BudgetTerm`, `BudgetArithmetic`) |

The contract imports nothing above it: where backends come from is `pytest_kvprofile.registry`, and what the engine
constructs for a model is `lifecycle/parts.py`.
"""
