"""--metric-opt-in-list, --metric-allowlist and --metric-denylist (kube-state-metrics' flags):
what /metrics shows.

Real exporters on one real tmpfs, side by side: one with the default set, one with a flag.
A denied family is gone and nothing else moved (every other series is there, with the same
labels); an opted-in family is there beside the whole default set, nothing else moved; an
allowlist keeps only its families of those; the allow- and denylist together, or lists that
leave no family, are refused at start-up, one line; a pattern that matches no family (a
misspelt name, or a comma list given as one regex) and the families the shipped rules read
that the lists leave out are said in the log.
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


def test_an_opted_in_family_appears_and_nothing_else_changes(tmpfs: str) -> None:
    """The opt-in list adds to the default set: an operator who wants the inode counts keeps
    every family the alerts and the dashboard read (an allowlist would have dropped them)."""
    fallocate(os.path.join(tmpfs, "psm_a"), MiB)
    with Exporter(f"--shm.mount={tmpfs}", *ARGS) as default, \
            Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-opt-in-list=shmwatch_mount_inodes.*",
                     env={"SHMWATCH_METRIC_OPT_IN_LIST": "shmwatch_mount_usage_ratio"}) as opted:
        full, more = default.scrape_text(), opted.scrape_text()
    added = {"shmwatch_mount_inodes", "shmwatch_mount_inodes_free"}  # the flag wins over the variable
    assert not added & families(full), "opt-in families are not in the default set"
    assert families(more) == families(full) | added
    assert {s for s in series(more) if not s.startswith(tuple(added))} == series(full)
    st = os.statvfs(tmpfs)
    s = parse_exposition(more)
    assert value(s, "shmwatch_mount_inodes", mount=tmpfs) == st.f_files
    assert value(s, "shmwatch_mount_inodes_free", mount=tmpfs) == st.f_ffree
    assert value(s, "shmwatch_mount_used_bytes", mount=tmpfs) == MiB


def test_an_allowlist_keeps_only_its_families_of_the_default_and_opted_in_ones(tmpfs: str) -> None:
    fallocate(os.path.join(tmpfs, "psm_a"), MiB)
    # (the collectors' durations: what the test's Exporter waits for to call it ready)
    with Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-allowlist=shmwatch_mount_inodes.*",
                  "--metric-allowlist=shmwatch_mount_usage_ratio", "--metric-allowlist=shmwatch_mount_used_bytes",
                  "--metric-allowlist=shmwatch_collector_duration_seconds",
                  "--metric-opt-in-list=shmwatch_mount_usage_ratio") as allowed:
        s = allowed.scrape()
        log = allowed.log()
    assert {name for name, _ in s} == {"shmwatch_mount_usage_ratio", "shmwatch_mount_used_bytes",
                                       "shmwatch_collector_duration_seconds"}  # inodes: not opted in
    st = os.statvfs(tmpfs)
    assert value(s, "shmwatch_mount_usage_ratio", mount=tmpfs) == MiB / (st.f_blocks * st.f_frsize)
    assert ("--metric-allowlist 'shmwatch_mount_inodes.*' matches only opt-in metric families not asked for: "
            "--metric-opt-in-list adds them") in log
    said = [line for line in log.splitlines() if "the shipped alerts, recording rules and dashboard read" in line]
    assert len(said) == 1 and "shmwatch_mount_size_bytes" in said[0] and "shmwatch_segment_bytes" in said[0], log
    assert "shmwatch_mount_used_bytes" not in said[0].split("leave out:")[1]


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


def test_lists_that_leave_no_family_are_refused_at_start() -> None:
    """`--metric-allowlist=` served an empty page (not even shmwatch_build_info) while up=1."""
    for args, env, said in ((("--metric-allowlist=",), None, "argument --metric-allowlist: an empty regex"),
                            (("--metric-allowlist=shmwatch_mount_inode",), None,
                             "argument --metric-allowlist: leaves no metric family to expose"),
                            ((), {"SHMWATCH_METRIC_DENYLIST": "shmwatch_.*, process_.*"},
                             "argument --metric-denylist: leaves no metric family to expose")):
        done = start(*args, env=env)
        assert done.returncode == 2, done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and done.stderr.startswith(f"shmwatch: error: {said}"), \
            done.stderr


def test_a_pattern_that_matches_no_family_is_said(tmpfs: str) -> None:
    with Exporter(f"--shm.mount={tmpfs}", *ARGS, "--metric-denylist=shmwatch_mount_size_bytes,shmwatch_mount_used_bytes",
                  "--metric-denylist=process_.*") as exporter:
        shown = families(exporter.scrape_text())
        log = exporter.log()
    assert "--metric-denylist 'shmwatch_mount_size_bytes,shmwatch_mount_used_bytes' matches no metric family" in log
    assert "process_.*" not in log
    assert {"shmwatch_mount_size_bytes", "shmwatch_mount_used_bytes"} <= shown  # one regex: nothing denied
