"""Root conftest: the plugin tests itself with pytester."""

pytest_plugins = ["pytester"]
