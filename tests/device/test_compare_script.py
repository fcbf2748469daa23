"""scripts/compare_allocator_gpu.py: the model column runs anywhere; without CUDA it says so."""

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "compare_allocator_gpu.py")


def load():
    spec = importlib.util.spec_from_file_location("compare_allocator_gpu", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_model_column_runs_and_ends_empty() -> None:
    script = load()
    rows = script.run_model(script.SEQUENCE, 80 << 30)
    assert len(rows) == len(script.SEQUENCE)
    assert rows[0]["reserved_bytes.all.current"] == 2 << 20
    assert rows[-1]["reserved_bytes.all.current"] == 0
    assert script.main(["--model-only"]) == 0


def test_exits_with_message_without_cuda(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present")
    assert load().main([]) == 2
    assert "no CUDA device is available" in capsys.readouterr().err
