"""Byte units, defined once: binary for memory (what allocators and FlashInfer count), decimal GB for
vendor capacities (what a GPU's marketed memory means); and how a message writes an amount of bytes, so that no
message prints "0.00 MiB" for bytes that are there."""

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
GB = 10**9

SMALL_BYTES = MiB // 100  # below 0.01 MiB, MiB with two decimals would round a real amount to nothing

__all__ = ["GB", "GiB", "KiB", "MiB", "SMALL_BYTES", "bytes_text", "size_text"]


def bytes_text(n: int) -> str:
    """An amount with its exact bytes: "3,128 bytes" under 0.01 MiB, else "12.50 MiB (13107200 bytes)"."""
    if abs(n) < SMALL_BYTES:
        return f"{n:,} bytes"
    return f"{n / MiB:.2f} MiB ({n} bytes)"


def size_text(n: int) -> str:
    """An amount in short: "3,128 bytes" under 0.01 MiB, else "12.50 MiB"."""
    if abs(n) < SMALL_BYTES:
        return f"{n:,} bytes"
    return f"{n / MiB:.2f} MiB"
