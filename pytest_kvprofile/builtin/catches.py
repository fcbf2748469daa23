"""What each mutant of the catalog fails over the default matrix: the catch table's columns, one record per mutant.

Own-class checks come with collateral ones (a lazily sized workspace also overruns after KV sizing, ...).
``tests/builtin/test_mutant_catalog.py`` proves each record against the sweep (exactly, over every default case, in
its slow sweep; a subset that holds an own-class check, in the plain run), and ``tests/acceptance/test_catalogs.py``
holds the catch table of docs/checks.md to these records.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EXPECTED_CATCHES", "ExpectedCatch"]


@dataclass(frozen=True)
class ExpectedCatch:
    """The checks one mutant fails over the default matrix (its bug class is the mutant's ``Backend.bug_class``)."""

    backend: str
    checks: frozenset[str]


_CATCHES: dict[str, tuple[str, ...]] = {
    "mutant-01-lazy-workspace": ("no_post_kv_overrun", "persistent_memory_visible_at_closing"),
    "mutant-01b-lazy-large-batch-wrapper": (
        "arena_stable_after_closing", "int_workspace_per_wrapper", "no_post_kv_overrun",
        "persistent_memory_visible_at_closing",
    ),
    "mutant-01c-torch-release-callback-allocates": ("no_post_kv_overrun", "persistent_memory_visible_at_closing"),
    "mutant-02-early-release": (
        "lease_outlives_closing_measurement", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
    ),
    "mutant-03-never-released": (
        "lease_released_before_graph_profiling", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
    ),
    "mutant-04a-grow-after-lock": (
        "arena_not_grown_after_lock", "arena_stable_after_closing", "int_workspace_per_wrapper", "no_post_kv_overrun",
        "no_use_after_free", "persistent_memory_visible_at_closing", "resource_capacity_honoured",
        "ubatch_arenas_disjoint", "warmup_idempotent",
    ),
    "mutant-04b-realloc-on-rebind": ("arena_stable_after_closing",),
    "mutant-04c-swallowed-grow-after-lock": ("arena_not_grown_after_lock",),
    "mutant-04d-remakes-captured-index-buffers": ("captured_memory_stays",),
    "mutant-05-ubatch-alias": ("ubatch_arenas_disjoint",),
    "mutant-05b-silent-ubatch-alias": ("ubatch_arenas_disjoint",),
    "mutant-06a-truthy-declaration": ("support_declaration",),
    "mutant-06b-unsupported-reserves": ("legacy_path_unchanged",),
    "mutant-07a-warmup-not-idempotent": (
        "no_post_kv_overrun", "persistent_memory_visible_at_closing", "warmup_idempotent",
    ),
    "mutant-07b-warmup-not-retryable": ("warmup_retryable",),
    "mutant-07c-warmup-retunes": ("warmup_idempotent",),
    "mutant-07d-post-kv-warmup-leaks": ("no_post_kv_overrun", "warmup_retryable"),
    "mutant-07e-torch-warmup-keeps-partial": ("warmup_retryable",),
    "mutant-08-profile-once": ("no_post_kv_overrun", "profile_replayed_after_warmup"),
    "mutant-09-synthetic-in-capture": ("no_synthetic_workspace_in_capture",),
    "mutant-09b-synthetic-in-captured-build": ("no_synthetic_workspace_in_capture",),
    "mutant-10-graph-gross-minus-retained": ("graph_pool_full_high_water", "no_post_kv_overrun"),
    "mutant-11-decode-heuristic-sizing": (
        "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays",
        "int_workspace_per_wrapper", "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
        "persistent_memory_visible_at_closing", "ubatch_arenas_disjoint", "warmup_idempotent",
        "workspace_covers_planner",
    ),
    "mutant-11b-fixed-default-view": ("no_post_kv_overrun", "workspace_covers_planner"),
    "mutant-12-wrong-version-formula": (
        "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays",
        "int_workspace_per_wrapper", "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
        "persistent_memory_visible_at_closing", "resource_capacity_honoured", "ubatch_arenas_disjoint",
        "warmup_idempotent", "workspace_covers_planner",
    ),
    "mutant-13a-resource-lazy": (
        "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "persistent_memory_visible_at_closing",
    ),
    "mutant-13b-resource-over-capacity": ("resource_capacity_honoured",),
    "mutant-13c-resource-in-capture": ("no_synthetic_workspace_in_capture",),
    "mutant-14a-global-after-kv-sizing": (
        "no_post_kv_overrun", "no_state_outlives_case", "persistent_memory_visible_at_closing",
    ),
    "mutant-14b-global-per-engine": ("no_state_outlives_case", "reservation_exception_safe"),
    "mutant-14c-torch-global-after-kv-sizing": (
        "no_post_kv_overrun", "no_state_outlives_case", "persistent_memory_visible_at_closing",
    ),
    "mutant-14d-torch-global-per-engine": ("no_state_outlives_case", "reservation_exception_safe"),
    "mutant-03b-torch-kept-and-remade": (
        "lease_released_before_graph_profiling", "no_post_kv_overrun", "persistent_memory_visible_at_closing",
    ),
    "mutant-05c-torch-data-ptr-alias": ("ubatch_arenas_disjoint",),
    "mutant-06c-neutral-frees-late-state-in-close": (
        "no_post_kv_overrun", "persistent_memory_visible_at_closing", "support_declaration",
    ),
    "mutant-06d-torch-neutral-frees-late-state-in-close": (
        "no_post_kv_overrun", "persistent_memory_visible_at_closing", "support_declaration",
    ),
    "mutant-18a-close-raises": ("teardown_clean",),
    "mutant-18b-close-double-free": ("teardown_clean",),
    "mutant-18c-torch-close-double-free": ("teardown_clean",),
    "mutant-15a-int-workspace-too-small": ("int_workspace_per_wrapper",),
    "mutant-15b-int-workspace-shared-by-wrappers": ("int_workspace_per_wrapper",),
    "mutant-15c-int-workspace-freed-early": ("int_workspace_per_wrapper", "no_post_kv_overrun", "no_use_after_free"),
    "mutant-15d-int-workspace-remade-after-capture": ("captured_memory_stays", "int_workspace_per_wrapper"),
    "mutant-15e-torch-int-workspace-too-small": ("int_workspace_per_wrapper",),
    "mutant-15f-torch-int-workspace-shared-by-ubatches": ("int_workspace_per_wrapper",),
    "mutant-15g-torch-int-workspace-freed-early": ("int_workspace_per_wrapper", "no_post_kv_overrun"),
    "mutant-15h-torch-int-workspace-remade-after-capture": (
        "arena_stable_after_closing", "captured_memory_stays", "int_workspace_per_wrapper",
    ),
    "mutant-05d-plans-into-other-ubatch": ("int_workspace_per_wrapper", "ubatch_arenas_disjoint"),
    "mutant-05e-torch-writes-other-ubatch": ("int_workspace_per_wrapper", "ubatch_arenas_disjoint"),
    "mutant-16a-plans-into-released-workspace": ("int_workspace_per_wrapper", "no_use_after_free"),
    "mutant-16b-stale-view-after-growth": ("no_use_after_free",),
    "mutant-16c-torch-stale-arena-view": ("no_use_after_free",),
    "mutant-17a-reservation-keeps-partial": ("reservation_exception_safe",),
    "mutant-17b-torch-reservation-keeps-partial": ("reservation_exception_safe",),
    "mutant-17c-cleanup-masks-first-error": ("reservation_exception_safe",),
    "mutant-11c-short-native-route": (
        "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays",
        "int_workspace_per_wrapper", "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
        "persistent_memory_visible_at_closing", "resource_capacity_honoured", "ubatch_arenas_disjoint",
        "warmup_idempotent", "workspace_covers_planner",
    ),
    "mutant-11d-torch-short-native-route": (
        "arena_not_grown_after_lock", "arena_stable_after_closing", "captured_memory_stays",
        "int_workspace_per_wrapper", "no_post_kv_overrun", "no_synthetic_workspace_in_capture", "no_use_after_free",
        "persistent_memory_visible_at_closing", "resource_capacity_honoured", "ubatch_arenas_disjoint",
        "warmup_idempotent", "workspace_covers_planner",
    ),
    "mutant-19a-vllm-default-arena-over-budget": ("workspace_covers_planner",),
    "mutant-19b-torch-vllm-default-arena-over-budget": ("workspace_covers_planner",),
    "mutant-19c-unused-trtllm-workspace": ("workspace_covers_planner",),
    "mutant-19d-private-float-workspace": ("workspace_covers_planner",),
}

EXPECTED_CATCHES: dict[str, ExpectedCatch] = {
    name: ExpectedCatch(name, frozenset(checks)) for name, checks in _CATCHES.items()
}
