"""The engine's phases, in the order the contract fixes (docs/contract.md, "The order").

Allocations, phase records and errors carry these names; checks compare positions in
``PHASE_ORDER`` to tell what happened before the closing measurement from what came after KV sizing.
"""

from __future__ import annotations

from typing import Final, Literal

Phase = Literal[
    "setup", "baseline", "reservation", "profile_run", "profile_warmup", "profile_replay", "closing_measurement",
    "lease_release", "graph_profiling", "kv_sizing", "rebind", "warmup", "capture", "lock", "serving",
    "warmup_repeat", "teardown",
]

SETUP: Final = "setup"
BASELINE: Final = "baseline"
RESERVATION: Final = "reservation"
PROFILE_RUN: Final = "profile_run"
PROFILE_WARMUP: Final = "profile_warmup"
PROFILE_REPLAY: Final = "profile_replay"
CLOSING: Final = "closing_measurement"
LEASE_RELEASE: Final = "lease_release"
GRAPH_PROFILING: Final = "graph_profiling"
KV_SIZING: Final = "kv_sizing"
REBIND: Final = "rebind"
WARMUP: Final = "warmup"
CAPTURE: Final = "capture"
LOCK: Final = "lock"
SERVING: Final = "serving"
WARMUP_REPEAT: Final = "warmup_repeat"
TEARDOWN: Final = "teardown"  # the parts' close(), after every phase the checks read: what it frees was alive

WINDOW_PHASES: Final[tuple[Phase, ...]] = (RESERVATION, PROFILE_RUN, PROFILE_WARMUP, PROFILE_REPLAY)
POST_KV_PHASES: Final[tuple[Phase, ...]] = (KV_SIZING, REBIND, WARMUP, CAPTURE, LOCK, SERVING, WARMUP_REPEAT)
PHASE_ORDER: Final[tuple[Phase, ...]] = (
    SETUP, BASELINE, RESERVATION, PROFILE_RUN, PROFILE_WARMUP, PROFILE_REPLAY, CLOSING, LEASE_RELEASE,
    GRAPH_PROFILING, KV_SIZING, REBIND, WARMUP, CAPTURE, LOCK, SERVING, WARMUP_REPEAT, TEARDOWN,
)
PHASE_INDEX: Final[dict[str, int]] = {name: i for i, name in enumerate(PHASE_ORDER)}
