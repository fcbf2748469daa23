"""How many CUDA devices there are, asked of NVML so that CUDA is never initialized here.

The xdist controller runs this; initializing CUDA there would break forked workers and hold a
context on every GPU. NVML answers without a CUDA context.
"""

from __future__ import annotations


def cuda_device_count() -> tuple[int, str]:
    """(count, why-zero). Zero when NVML or its driver is missing."""
    try:
        import pynvml
    except ImportError:
        return 0, "the nvidia-ml-py package (module pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # noqa: BLE001 - pynvml raises NVMLError subclasses with no common import
        return 0, f"NVML could not be initialized: {exc}"
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except Exception as exc:  # noqa: BLE001
        return 0, f"NVML could not count devices: {exc}"
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - shutdown failures change nothing for the answer
            pass
    return count, "NVML reports no devices" if count == 0 else ""
