"""JUnit XML classnames that carry the backend: ``pytest_kvprofile.suite.test_conformance.<backend>``.

pytest's ``--junitxml`` names every suite result's class after its module, ``test_conformance``, so a CI page
groups every backend's results into one class. The controller (under xdist too: it writes the XML) gives each
suite result the backend as the last part of its classname, before pytest's JUnit reporter reads the report.
"""

from __future__ import annotations

import pytest

from pytest_kvprofile.plugin.recorder import RECORD_KEY


class JunitClassnames:
    def __init__(self, config: pytest.Config):
        self.config = config

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        from _pytest.junitxml import mangle_test_address, xml_key  # pytest's own reporter, present with --junitxml

        xml = self.config.stash.get(xml_key, None)
        data = dict(report.user_properties).get(RECORD_KEY)
        if xml is None or not isinstance(data, dict):
            return
        names = mangle_test_address(report.nodeid)[:-1]
        if xml.prefix:
            names.insert(0, xml.prefix)
        xml.node_reporter(report).add_attribute("classname", ".".join([*names, str(data["backend"])]))
