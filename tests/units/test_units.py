"""How messages write amounts: exact bytes for small ones, never "0.00 MiB" for bytes that are there (issue 32)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from pytest_kvprofile.units import SMALL_BYTES, MiB, bytes_text, size_text


def test_small_amounts_are_written_in_exact_bytes():
    assert bytes_text(3128) == size_text(3128) == "3,128 bytes"
    assert bytes_text(0) == "0 bytes"
    assert bytes_text(5 * MiB) == "5.00 MiB (5242880 bytes)" and size_text(5 * MiB) == "5.00 MiB"


@given(st.integers(min_value=-(1 << 40), max_value=1 << 40))
def test_no_nonzero_amount_reads_as_zero(n):
    for text in (bytes_text(n), size_text(n)):
        assert n == 0 or "0.00 MiB" not in text, text
        assert (text == f"{n:,} bytes") == (abs(n) < SMALL_BYTES), text
