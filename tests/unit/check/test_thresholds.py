"""Tests of exporter/check/thresholds.py."""

import os

from tests.conftest import REPO


def test_check_judges_by_the_rules_thresholds():
    """`shmwatch check` and the alert rules say the same thing at the same numbers."""
    import re

    import yaml

    from exporter.check import thresholds as T
    with open(os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")) as f:
        rules = {r["alert"]: r["expr"] for g in yaml.safe_load(f)["groups"] for r in g["rules"] if "alert" in r}
    expected = {
        "ShmUsageHigh": (">", T.SHM_USAGE_WARNING_RATIO), "ShmUsageCritical": (">", T.SHM_USAGE_CRITICAL_RATIO),
        "PodOomRiskHigh": (">", T.OOM_RISK_RATIO), "ShmSizeExceedsMemoryLimit": (">", T.SHM_OOM_PROJECTION_RATIO),
        "HostMemoryLow": ("<", T.HOST_MEMORY_AVAILABLE_LOW_RATIO), "SysvSegmentsNearLimit": (">", T.SYSV_NEAR_LIMIT_RATIO),
        "SysvBytesNearLimit": (">", T.SYSV_NEAR_LIMIT_RATIO), "GpuMemoryNearlyFull": (">", T.GPU_MEMORY_FULL_RATIO),
        "ShmDockerDefaultSize": ("<=", T.DOCKER_DEFAULT_SHM_BYTES),
    }
    for alert, (op, number) in expected.items():
        found = [float(x) for x in re.findall(re.escape(op) + r"\s*([0-9.]+)", rules[alert])]
        assert number in found, f"{alert}: rule says {rules[alert]!r}, exporter/check/thresholds.py says {op} {number}"
