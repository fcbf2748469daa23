"""The host version of FlashInfer's bit packing (``attention/host_packbits.py``), against FlashInfer's documented
examples and ``numpy.packbits``, and as the simulated GPU serves it to FlashInfer's own ``segment_packbits``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
np = pytest.importorskip("numpy")

from pytest_kvprofile.attention.host_packbits import host_quantization_module  # noqa: E402

BITS = [1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]


def _segments(bitorder: str) -> list[int]:
    x = torch.tensor(BITS, dtype=torch.bool)
    indptr = torch.tensor([0, 4, 7, 11], dtype=torch.int32)
    indptr_new = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    y = torch.zeros(3, dtype=torch.uint8)
    host_quantization_module().segment_packbits(x, indptr, indptr_new, bitorder, y)
    return y.tolist()


def test_segments_pack_as_flashinfers_documented_example():
    assert [bin(v) for v in _segments("big")] == ["0b10110000", "0b100000", "0b11010000"]


def test_little_bit_order_reverses_each_byte():
    assert _segments("little") == [int(f"{v:08b}"[::-1], 2) for v in _segments("big")]


def test_packbits_is_numpys():
    x = torch.tensor(BITS, dtype=torch.bool)
    y = torch.zeros(2, dtype=torch.uint8)
    host_quantization_module().packbits(x, "big", y)
    assert y.tolist() == np.packbits(np.array(BITS, dtype=bool)).tolist() == [0b10110011, 0b10100000]


def test_an_output_layout_that_does_not_match_the_segments_is_refused():
    x = torch.ones(9, dtype=torch.bool)
    with pytest.raises(ValueError, match="segment 0 packs to 2 bytes, indptr_new gives 1"):
        host_quantization_module().segment_packbits(x, torch.tensor([0, 9]), torch.tensor([0, 1]), "big",
                                                    torch.zeros(2, dtype=torch.uint8))


def test_the_simulated_gpu_serves_flashinfers_segment_packbits():
    pytest.importorskip("flashinfer")
    from flashinfer.quantization import segment_packbits

    from pytest_kvprofile.memory.simulated_gpu import simulated_gpu

    with simulated_gpu("L40S", flashinfer=True):
        x = torch.tensor(BITS, dtype=torch.bool)
        y, indptr = segment_packbits(x, torch.tensor([0, 4, 7, 11], dtype=torch.int32), bitorder="little")
    assert indptr.tolist() == [0, 1, 2, 3]
    assert [bin(v) for v in y.tolist()] == ["0b1101", "0b100", "0b1011"]
