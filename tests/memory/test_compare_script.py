"""scripts/compare_allocator_gpu.py: the model column runs anywhere; without CUDA it says so."""

import importlib.util
import os
from typing import Any

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


class _FakeCudaForScript:
    """Just enough of torch.cuda for run_torch: records graph resets and what each empty_cache saw."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self) -> None:
        import weakref

        self.events: list[str] = []
        self.graphs: list[Any] = []
        self._weakref = weakref.ref
        fake = self

        class Graph:
            def reset(self) -> None:
                fake.events.append("reset")

        class GraphCtx:
            def __init__(self, graph: Any, stream: Any = None, pool: Any = None) -> None:
                self.cuda_graph = graph  # as torch.cuda.graph does: the context keeps the graph

            def __enter__(self) -> None:
                fake.events.append("capture")

            def __exit__(self, *exc: Any) -> None:
                fake.events.append("capture_end")

        def new_graph() -> Any:
            g = Graph()
            self.graphs.append(self._weakref(g))
            return g

        self.CUDAGraph = new_graph
        self.graph = GraphCtx

    def empty_cache(self) -> None:
        alive = any(ref() is not None for ref in self.graphs)
        self.events.append("empty_cache(graph alive)" if alive else "empty_cache")

    def init(self) -> None: ...
    def synchronize(self) -> None: ...
    def reset_peak_memory_stats(self) -> None: ...
    def memory_stats(self) -> dict[str, int]:
        return {}

    def Stream(self) -> object:  # noqa: N802 - torch's name
        return object()


def test_release_graph_resets_and_drops_the_captured_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    import sys
    from types import SimpleNamespace

    cuda = _FakeCudaForScript()
    fake_torch = SimpleNamespace(cuda=cuda, uint8="uint8", empty=lambda n, dtype=None, device=None: SimpleNamespace(
        zero_=lambda: None))
    monkeypatch.setitem(sys.modules, "torch", fake_torch)
    script = load()
    script.run_torch(script.SEQUENCE)
    after = cuda.events[cuda.events.index("capture_end") + 1:]
    assert "reset" in after, "release_graph never reset the graph"
    released = after[after.index("reset") + 1:]
    assert released and released[0] == "empty_cache", (
        f"the graph was still referenced at the empty_cache after release_graph: {after}")
