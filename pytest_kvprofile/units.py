"""Byte units, defined once: binary for memory (what allocators and FlashInfer count), decimal GB for
vendor capacities (what a GPU's marketed memory means)."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9

__all__ = ["GB", "GiB", "KiB", "MiB"]
