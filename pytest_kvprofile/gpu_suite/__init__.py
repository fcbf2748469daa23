"""The GPU tier's tests: run with ``pytest --kvprofile-gpu --pyargs pytest_kvprofile.gpu_suite``.

The GPU tier has three homes, one per layer: ``gpu/`` is the hardware library (no pytest, below the plugin),
``plugin/gpu.py`` wires it into pytest (``--kvprofile-gpu``, pinning, fixtures), and this package holds the test
modules, beside ``suite/`` and above the plugin. Moving these tests under ``gpu/`` would make that library import
pytest and the plugin.
"""
