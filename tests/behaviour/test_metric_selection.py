"""--metric-allowlist and --metric-denylist (kube-state-metrics' flags): what /metrics shows.

Real exporters on one real tmpfs, side by side: one with the default set, one with a flag.
A denied family is gone and nothing else moved (every other series is there, with the same
labels); an allowlisted opt-in family is there, and only the allowlisted ones; the two flags
together are refused at start-up, one line naming both; a pattern that matches no family
(a misspelt name, or a comma list given as one regex) is said in the log.
"""

import os
import subprocess
import sys
from typing import Set

from tests.conftest import REPO, Exporter, fallocate, needs_root, parse_exposition, value

pytestmark = needs_root

MiB = 1 << 20
ARGS = ("--no-collector.gpu", "--inventory-interval=300ms")


def series(text: str) -> Set[str]:
    """Each sample's name and labels (values move between two scrapes; series must not)."""
    return {f"{name}{sorted(labels)}" for name, labels in parse_exposition(text)}


def families(text: str) -> Set[str]:
    return {name for name, _ in parse_exposition(text)}


def test_a_denied_family_is_absent_and_nothing_else_changes(tmpfs: str) -> None:
    fallocate(os.path.join(tmpfs, "psm_a"), MiB)
    fallocate(os.path.join(tmpfs, "nccl-b"), 2 * MiB)
    with Exporter(f"--shm.mount={tmpfs}", *ARGS) as default, \
            Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-denylist=shmwatch_segment_bytes",
                     "--metric-denylist=shmwatch_cgroup_oom_kills") as denied:
        full, less = default.scrape_text(), denied.scrape_text()
    gone = {"shmwatch_segment_bytes", "shmwatch_cgroup_oom_kills_total"}
    assert gone <= families(full), "the families to deny are in the default set"
    assert not gone & families(less)
    kept = {s for s in series(full) if not s.startswith(tuple(gone))}
    assert series(less) == kept
    assert value(parse_exposition(less), "shmwatch_mount_used_bytes", mount=tmpfs) == 3 * MiB


def test_the_denylist_from_its_variable_is_a_comma_list(tmpfs: str) -> None:
    fallocate(os.path.join(tmpfs, "psm_a"), MiB)
    env = {"SHMWATCH_METRIC_DENYLIST": "shmwatch_segments,process_.*"}
    with Exporter(f"--shm.mount={tmpfs}", *ARGS, env=env) as exporter:
        shown = families(exporter.scrape_text())
    assert "shmwatch_segments" not in shown and not [f for f in shown if f.startswith("process_")]
    assert "shmwatch_segment_bytes" in shown  # anchored: shmwatch_segments is not a prefix


def test_an_allowlisted_opt_in_family_appears_and_only_the_allowlisted_ones(tmpfs: str) -> None:
    fallocate(os.path.join(tmpfs, "psm_a"), MiB)
    with Exporter(f"--shm.mount={tmpfs}", *ARGS) as default:
        assert "shmwatch_mount_inodes_free" not in families(default.scrape_text())  # opt-in
    # (the collectors' durations: what the test's Exporter waits for to call it ready)
    with Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-allowlist=shmwatch_mount_inodes.*",
                  "--metric-allowlist=shmwatch_mount_usage_ratio",
                  "--metric-allowlist=shmwatch_collector_duration_seconds") as allowed:
        s = allowed.scrape()
    assert {name for name, _ in s} == {"shmwatch_mount_inodes", "shmwatch_mount_inodes_free",
                                       "shmwatch_mount_usage_ratio", "shmwatch_collector_duration_seconds"}
    st = os.statvfs(tmpfs)
    assert value(s, "shmwatch_mount_inodes", mount=tmpfs) == st.f_files
    assert value(s, "shmwatch_mount_inodes_free", mount=tmpfs) == st.f_ffree
    assert value(s, "shmwatch_mount_usage_ratio", mount=tmpfs) == MiB / (st.f_blocks * st.f_frsize)


def start(*args: str, env=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "exporter", "--web.listen-address=127.0.0.1:0", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=30, env={**os.environ, **(env or {})})


def test_both_flags_together_are_refused_naming_both() -> None:
    for args, env in ((("--metric-allowlist=shmwatch_.*", "--metric-denylist=process_.*"), None),
                      (("--metric-allowlist=shmwatch_.*",), {"SHMWATCH_METRIC_DENYLIST": "process_.*"})):
        done = start(*args, env=env)
        assert done.returncode == 2, done.stderr
        assert done.stderr.strip().splitlines() == [
            "shmwatch: error: arguments --metric-allowlist and --metric-denylist: give one, not both"], done.stderr


def test_a_pattern_that_matches_no_family_is_said(tmpfs: str) -> None:
    with Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-denylist=shmwatch_mount_size_bytes,shmwatch_mount_used_bytes",
                  "--metric-denylist=process_.*") as exporter:
        shown = families(exporter.scrape_text())
        log = exporter.log()
    assert "--metric-denylist 'shmwatch_mount_size_bytes,shmwatch_mount_used_bytes' matches no metric family" in log
    assert "process_.*" not in log
    assert {"shmwatch_mount_size_bytes", "shmwatch_mount_used_bytes"} <= shown  # one regex: nothing denied
