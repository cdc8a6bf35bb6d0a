"""Test-wide settings."""

from __future__ import annotations

import os

from hypothesis import settings

# CI gates a landing: it explores a fixed, reproducible set of examples. Local runs keep
# exploring new ones (and remember failures in .hypothesis/), which is where bugs are found.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")

# mlx-lm lowers the process's hard limit of open files to 4,096 when first imported (`exod.runner.mlx_import`).
# Tests import it directly too; a lowered limit is inherited by every process the suite starts after, and
# where raising a hard limit takes a privilege (CAP_SYS_RESOURCE) the tests of that import fail. Imported
# first, through exod's door: the suite's limits stay what they were, whatever the order of its tests.
from exod.runner.mlx_import import import_mlx_lm  # noqa: E402

import_mlx_lm()

from etcd_harness import etcd, etcd_cluster, etcd_server, secure_etcd  # noqa: E402, F401 - a real etcd, for the cluster's tests
from netns_harness import namespace  # noqa: E402, F401 - a host of its own, for partitions

from browser_harness import browser  # noqa: E402, F401 - headless Chromium, for the dashboard's tests

# Modules that start runner processes opt in with `pytestmark = pytest.mark.usefixtures("no_runner_left_behind")`.
from daemon_harness import no_runner_left_behind  # noqa: E402, F401
from real_model_harness import real_model_home  # noqa: E402, F401 - the real instruct model, imported once per run


def pytest_sessionfinish(session, exitstatus):
    """`make reliability`: the attacks table of specs/reliability.md, once every attack ran and passed."""
    import reliability_report

    if reliability_report.WRITE and exitstatus == 0 and not reliability_report.write_attacks():
        missing = sorted(set(reliability_report.ATTACKS) - set(reliability_report.OBSERVED))
        print(f"\nspecs/reliability.md: attacks table not written, not observed in this run: {missing}")
    if reliability_report.WRITE and exitstatus == 0 and not reliability_report.write_cluster():
        missing = sorted(set(reliability_report.CLUSTER) - set(reliability_report.CLUSTER_OBSERVED))
        print(f"\nspecs/reliability.md: cluster table not written, not observed in this run: {missing}")
