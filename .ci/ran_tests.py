"""A pytest plugin of `.ci/run`'s (``-p ran_tests`` with ``.ci`` on ``PYTHONPATH``): every test runs
once, and the README's test command still runs exactly as written.

* ``--record-ran=FILE``: append the node id of each test that passes to FILE (the README's quick
  run, before the extras are installed);
* ``--skip-ran=FILE``: deselect the tests FILE names (the run with every extra: the slow set, and
  the quick tests the first run did not pass: those it skipped for an extra it lacked, and those
  an extra adds, such as the Flax and Equinox cases of the benchmarks).

Standard library and pytest only.
"""

import os
from pathlib import Path

#: The file the node ids of passing tests go to (``--record-ran``), or None.
_record = None


def pytest_addoption(parser):
    group = parser.getgroup("ran_tests", ".ci/run: run each test once")
    group.addoption("--record-ran", metavar="FILE", help="append the node id of each passing test to FILE")
    group.addoption("--skip-ran", metavar="FILE", help="deselect the tests FILE names")


def pytest_runtest_logreport(report):
    path = _record
    if path is not None and report.when == "call" and report.passed:
        with open(path, "a") as file:
            file.write(report.nodeid + "\n")


def pytest_configure(config):
    global _record
    _record = config.getoption("record_ran")
    if _record is not None:
        # .ci/run passes the recording through the environment (the README's command as written):
        # a test's own child processes (a pytest run, a fresh environment) must not inherit it
        for name in ("PYTEST_ADDOPTS", "PYTHONPATH"):
            os.environ.pop(name, None)


def pytest_collection_modifyitems(config, items):
    path = config.getoption("skip_ran")
    if path is None:
        return
    ran = set(Path(path).read_text().splitlines())
    keep, drop = [], []
    for item in items:
        (drop if item.nodeid in ran else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
