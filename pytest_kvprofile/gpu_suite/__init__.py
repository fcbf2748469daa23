"""The GPU tier's tests: run with ``pytest --kvprofile-gpu --pyargs pytest_kvprofile.gpu_suite``."""
