"""Run a probe step in a child process forked from the current state, so probes share the run up to a fault point.

A probe that fails a builder at its allocation ``k`` needs the state just before the builder is asked (fresh builders
driven up to their reservation or warmup). Building that state once and forking one child per fault point gives every
fault the same starting state a fresh run would, at the cost of a fork instead of a lifecycle prefix. The child returns
a picklable value through a pipe and leaves with ``os._exit``: it never touches pytest's or xdist's channels, stdio
buffers or the parent's files. Only the simulated device forks: a process that has initialized CUDA cannot use it in a
child, so the GPU tier (and a platform without ``fork``) re-runs the prefix instead (``can_fork``).

A fork is worth it only where the prefix costs more than the fork. A fork of a process with torch and FlashInfer
imported costs about 25 ms of CPU (its page tables, and the copy-on-write faults it leaves the parent); the prefix
up to a reservation costs 0.1 ms for a context-mode stub, 1 to 3 ms for a torch-mode stub or the real-FlashInfer
backend, and about 55 ms for vLLM's builders (measured on ci.yaml's first case). ``worth_forking`` decides from the
backend, never from a timing, so a case's probes take the same path on every run: a torch-mode backend that runs an
engine's builders (``Backend.requires`` names the engine) forks, every other re-runs its prefix.
``KVPROFILE_PROBE_FORK`` chooses: ``never`` (the default), ``auto`` (that rule), ``always``; ``KVPROFILE_NO_FORK=1``
is ``never``. Forking is opt-in because twice, on a loaded machine under ``-n 2``, a forked backend's
``reservation_exception_safe`` failed on a case where the re-run prefix passes it (``mutant-06d`` with every backend
forked; ``vllm-pr-*`` on three glm-4-9b TP4 B200 cases with ``auto``), and neither reproduced alone: until that is
understood, the default is the path whose verdicts every comparison has held.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import sys
import warnings
from typing import Callable, TypeVar

__all__ = ["ChildFailed", "can_fork", "in_child", "worth_forking"]

T = TypeVar("T")

_ENV = "KVPROFILE_PROBE_FORK"  # "never" (default), "auto" or "always"
_NEVER_ENV = "KVPROFILE_NO_FORK"  # set (to anything but "" or "0"): "never", re-run every prefix as before forking
_POLICIES = ("auto", "always", "never")


def _policy() -> str:
    if os.environ.get(_NEVER_ENV, "") not in ("", "0"):
        return "never"
    value = os.environ.get(_ENV, "") or "never"
    if value not in _POLICIES:
        raise ValueError(f"{_ENV}={value!r}: expected one of {', '.join(_POLICIES)}")
    return value


class ChildFailed(RuntimeError):
    """The forked child died before it sent its answer (a crash, a signal): the probe step is re-run in-process."""


def can_fork() -> bool:
    """Whether probe steps may run in forked children here: ``os.fork`` exists, it is not switched off, and this
    process has not initialized CUDA (the simulated device's probes only)."""
    if not hasattr(os, "fork") or _policy() == "never":
        return False
    torch = sys.modules.get("torch")
    return torch is None or not torch.cuda.is_initialized()


def worth_forking(torch_mode: bool, engine: bool) -> bool:
    """Whether a backend's probe prefixes are worth a fork (``can_fork`` says whether one is possible): an engine's
    builders in torch mode, or the ``always`` policy."""
    return (torch_mode and engine) or _policy() == "always"


class _Raised:
    """An exception the child raised, carried as text when it does not pickle: the parent raises one of the same type
    name and message (and explicit cause), which is what the probes report."""

    def __init__(self, exc: BaseException) -> None:
        self.chain: list[tuple[str, str]] = []
        seen: BaseException | None = exc
        while seen is not None and len(self.chain) < 8:
            self.chain.append((type(seen).__name__, str(seen)))
            seen = seen.__cause__

    def rebuild(self) -> Exception:
        out: Exception | None = None
        for name, text in reversed(self.chain):
            exc = type(name, (Exception,), {})(text)
            exc.__cause__ = out
            out = exc
        assert out is not None
        return out


def in_child(fn: Callable[[], T]) -> T:
    """``fn()`` evaluated in a child forked from here; its value, or the exception it raised, comes back. Raises
    :class:`ChildFailed` when the child dies without answering."""
    read_fd, write_fd = os.pipe()
    pid = -1
    gc.freeze()  # the child's collections skip the parent's objects, so they do not copy every page the heap holds
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12: "use of fork() may lead to deadlocks"
            pid = os.fork()
    finally:
        if pid != 0:
            gc.unfreeze()
    if pid == 0:  # the child: answer, then leave without running the parent's exit handlers
        os.close(read_fd)
        _serve(fn, write_fd)
    os.close(write_fd)
    try:
        chunks = []
        while True:
            chunk = os.read(read_fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    except BaseException:
        os.kill(pid, signal.SIGKILL)
        raise
    finally:
        os.close(read_fd)
        _, status = os.waitpid(pid, 0)
    if not chunks:
        raise ChildFailed(f"the probe's forked child ended with status {status} and no answer")
    ok, value = pickle.loads(b"".join(chunks))
    if ok:
        return value  # type: ignore[no-any-return]
    raise value.rebuild() if isinstance(value, _Raised) else value


def _serve(fn: Callable[[], object], write_fd: int) -> None:
    code = 0
    try:
        torch = sys.modules.get("torch")
        if torch is not None:
            torch.set_num_threads(1)  # the parent's OpenMP pool does not exist here
        try:
            payload = pickle.dumps((True, fn()))
        except Exception as exc:  # noqa: BLE001 - carried to the parent, which raises it where fn was called
            try:
                payload = pickle.dumps((False, exc))
                pickle.loads(payload)
            except Exception:  # noqa: BLE001 - an exception that does not survive pickling
                payload = pickle.dumps((False, _Raised(exc)))
        view = memoryview(payload)
        while view:
            view = view[os.write(write_fd, view):]
    except BaseException:  # noqa: BLE001 - no answer: the parent re-runs the step
        code = 1
    finally:
        os._exit(code)
