"""The engine's phases, in the order the contract fixes (docs/contract.md, "The order").

Allocations, phase records and errors carry these names; checks compare positions in
``PHASE_ORDER`` to tell what happened before the closing measurement from what came after KV sizing.
"""

from __future__ import annotations

SETUP = "setup"
BASELINE = "baseline"
RESERVATION = "reservation"
PROFILE_RUN = "profile_run"
PROFILE_WARMUP = "profile_warmup"
PROFILE_REPLAY = "profile_replay"
CLOSING = "closing_measurement"
LEASE_RELEASE = "lease_release"
GRAPH_PROFILING = "graph_profiling"
KV_SIZING = "kv_sizing"
REBIND = "rebind"
WARMUP = "warmup"
CAPTURE = "capture"
LOCK = "lock"
SERVING = "serving"
WARMUP_REPEAT = "warmup_repeat"
TEARDOWN = "teardown"  # the parts' close(), after every phase the checks read: what it frees was alive at the end

WINDOW_PHASES = (RESERVATION, PROFILE_RUN, PROFILE_WARMUP, PROFILE_REPLAY)
POST_KV_PHASES = (KV_SIZING, REBIND, WARMUP, CAPTURE, LOCK, SERVING, WARMUP_REPEAT)
PHASE_ORDER = (
    SETUP, BASELINE, RESERVATION, PROFILE_RUN, PROFILE_WARMUP, PROFILE_REPLAY, CLOSING, LEASE_RELEASE,
    GRAPH_PROFILING, KV_SIZING, REBIND, WARMUP, CAPTURE, LOCK, SERVING, WARMUP_REPEAT, TEARDOWN,
)
PHASE_INDEX = {name: i for i, name in enumerate(PHASE_ORDER)}
