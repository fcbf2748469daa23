"""Root conftest: the plugin tests itself with pytester.

pytester points HOME at a temporary directory for every run; pin the oracle's cache to the real
one first, so the FlashInfer planner library is compiled once per machine, not once per test.
"""

import os

from pytest_kvprofile.sizing.oracle import cache_root

os.environ.setdefault("KVPROFILE_CACHE_DIR", str(cache_root()))

pytest_plugins = ["pytester"]
