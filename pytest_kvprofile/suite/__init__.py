"""The conformance suite the plugin parametrizes from the matrices (run: pytest --pyargs pytest_kvprofile.suite)."""
