"""What an allocation is for: the role the checks read instead of tag strings.

A builder names the role when it allocates (``ctx.allocate(nbytes, tag, role=Role.INT_WORKSPACE)``); in torch
mode the harness recognizes FlashInfer's own wrapper buffers by role. Everything else is ``OTHER``.
"""

from __future__ import annotations

from enum import Enum


class Role(str, Enum):
    """The part an allocation plays in the contract."""

    FLOAT_ARENA = "float-arena"  # the shared float workspace the engine's manager owns (one per micro-batch)
    FLOAT_WORKSPACE = "float-workspace"  # float workspace a builder keeps for its wrappers beside the arena
    INT_WORKSPACE = "int-workspace"  # a wrapper's dedicated int workspace (FlashInfer: 8 MiB by default)
    PINNED_MIRROR = "pinned-mirror"  # the pinned host copy of an int workspace
    TRTLLM_WORKSPACE = "trtllm-workspace"  # FlashInfer's trtllm-gen workspace (one per process in vLLM)
    OTHER = "other"

    def __str__(self) -> str:
        return self.value


def as_role(value: "Role | str") -> Role:
    """A role from its member or value; anything else is a TypeError naming the allowed values."""
    if type(value) is Role:
        return value
    try:
        return Role(value)
    except ValueError:
        allowed = ", ".join(r.value for r in Role)
        raise TypeError(f"role must be a pytest_kvprofile Role ({allowed}), not {value!r}") from None
