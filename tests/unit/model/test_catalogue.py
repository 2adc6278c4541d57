"""model/catalogue.py: the families, their defaults, and what --metric-opt-in-list,
--metric-allowlist and --metric-denylist (kube-state-metrics' flags) make of them."""

import re

import pytest

from exporter.model.catalogue import (
    BY_NAME,
    CATALOGUE,
    DEFAULT_SET,
    NODE_MOUNT_LABELS,
    READ_BY_RULES_AND_DASHBOARD,
    MetricSelection,
    lookup,
    node_labels,
)

INODES = {"shmwatch_mount_inodes", "shmwatch_mount_inodes_free"}  # opt-in


def test_rows_are_consistent():
    assert len(BY_NAME) == len(CATALOGUE)
    for m in CATALOGUE:
        base = m.name.removesuffix("_total")
        assert m.type == ("gauge" if base == m.name else "counter"), m.name
        assert m.unit == next((u for u in ("bytes", "seconds", "ratio") if base.endswith("_" + u)), ""), m.name
        assert m.help and not m.help.endswith(" ") and "  " not in m.help, m.name
        assert isinstance(m.default, bool), m.name
    assert DEFAULT_SET == {m.name for m in CATALOGUE if m.default}
    assert READ_BY_RULES_AND_DASHBOARD <= DEFAULT_SET  # (tests/system/test_rules.py: it is what they read)


def test_no_default_family_names_a_pid():
    """A pid is a label of no family, default or not: a series per restart."""
    assert not [m.name for m in CATALOGUE if "pid" in m.labels]


def test_the_default_set_without_flags():
    assert MetricSelection().exposed() == DEFAULT_SET
    assert "shmwatch_mount_usage_ratio" not in DEFAULT_SET and "shmwatch_mount_used_bytes" in DEFAULT_SET
    assert MetricSelection().warnings() == ()


def test_an_opt_in_family_is_added_to_the_default_set_and_nothing_else_changes():
    assert not INODES & DEFAULT_SET
    assert MetricSelection(opt_in=("shmwatch_mount_inodes.*",)).exposed() == DEFAULT_SET | INODES
    assert MetricSelection(opt_in=(".*",)).exposed() == set(BY_NAME)
    assert MetricSelection(opt_in=("shmwatch_mount_used_bytes",)).exposed() == DEFAULT_SET  # default already
    assert MetricSelection(opt_in=("shmwatch_segment_events",)).exposed() == DEFAULT_SET | {
        "shmwatch_segment_events_total"}  # a counter by its family name
    assert MetricSelection(opt_in=("shmwatch_mount_inodes.*",)).warnings() == ()


def test_a_denylist_takes_families_out_of_the_default_set_and_the_opted_in_ones():
    denied = MetricSelection(denylist=("shmwatch_mount_.*_bytes", "shmwatch_top_segment_bytes")).exposed()
    assert denied == DEFAULT_SET - {n for n in DEFAULT_SET if re.fullmatch("shmwatch_mount_.*_bytes", n)} - {
        "shmwatch_top_segment_bytes"}
    assert "shmwatch_mount_inodes" not in denied  # opt-in stays out
    opted = MetricSelection(opt_in=("shmwatch_mount_inodes.*",), denylist=("shmwatch_mount_inodes",))
    assert opted.exposed() == DEFAULT_SET | {"shmwatch_mount_inodes_free"}
    # Anchored: a pattern matches a whole name, never a part of one.
    assert MetricSelection(denylist=("mount",)).exposed() == DEFAULT_SET
    assert MetricSelection(denylist=("shmwatch_mount_size",)).exposed() == DEFAULT_SET


def test_an_allowlist_keeps_only_its_families_of_the_default_and_opted_in_ones():
    assert MetricSelection(allowlist=("shmwatch_mount_.*_bytes",)).exposed() == {
        n for n in DEFAULT_SET if re.fullmatch("shmwatch_mount_.*_bytes", n)}
    # An opt-in family needs the opt-in list too, as in kube-state-metrics.
    assert MetricSelection(allowlist=("shmwatch_mount_inodes.*",)).exposed() == frozenset()
    both = MetricSelection(allowlist=("shmwatch_mount_inodes.*",), opt_in=("shmwatch_mount_inodes.*",))
    assert both.exposed() == INODES
    assert MetricSelection(allowlist=(".*",)).exposed() == DEFAULT_SET
    # A counter by its family name (without _total) or its sample name.
    assert MetricSelection(allowlist=("shmwatch_cgroup_oom_kills",)).exposed() == {"shmwatch_cgroup_oom_kills_total"}
    assert MetricSelection(allowlist=("shmwatch_cgroup_oom_kills_total",)).exposed() == {
        "shmwatch_cgroup_oom_kills_total"}
    assert MetricSelection(allowlist=("shmwatch_mount",)).exposed() == frozenset()


@pytest.mark.parametrize("pattern,matches", [
    ("shmwatch_mount_size_bytes", True), ("shmwatch_.*", True), ("shmwatch_top_segment_bytes", True),
    ("nope", False), ("shmwatch_mount_size_bytes,shmwatch_mount_used_bytes", False), ("shmwatch_mount", False),
])
def test_a_pattern_that_matches_no_family_is_said(pattern, matches):
    said = MetricSelection(denylist=(pattern,)).warnings()
    unmatched = f"--metric-denylist {pattern!r} matches no metric family"
    assert (unmatched in said) is not matches, said


def test_an_opt_in_pattern_that_matches_no_opt_in_family_is_said():
    said = MetricSelection(opt_in=("shmwatch_mount_inode", "shmwatch_mount_used_bytes", "shmwatch_mount_inodes")).warnings()
    assert said == ("--metric-opt-in-list 'shmwatch_mount_inode' matches no opt-in metric family",
                    "--metric-opt-in-list 'shmwatch_mount_used_bytes' matches no opt-in metric family")


def test_an_allowlisted_opt_in_family_not_opted_in_is_said():
    said = MetricSelection(allowlist=("shmwatch_mount_inodes", ".*")).warnings()
    assert said == ("--metric-allowlist 'shmwatch_mount_inodes' matches only opt-in metric families not asked "
                    "for: --metric-opt-in-list adds them",)


def test_the_families_the_rules_and_dashboard_read_that_the_lists_leave_out_are_said():
    said = MetricSelection(denylist=("shmwatch_segment_bytes", "shmwatch_gpu_.*", "process_.*")).warnings()
    assert said == ("the shipped alerts, recording rules and dashboard read families the allow/deny lists leave "
                    "out: shmwatch_gpu_info, shmwatch_gpu_memory_reserved_bytes, shmwatch_gpu_memory_total_bytes, "
                    "shmwatch_gpu_memory_used_bytes, shmwatch_gpu_process_memory_bytes, shmwatch_segment_bytes",)
    said = MetricSelection(allowlist=("shmwatch_.*",)).warnings()
    assert said == ()  # every family they read is a shmwatch_ one
    said = MetricSelection(allowlist=("shmwatch_mount_.*",), opt_in=("shmwatch_mount_inodes",)).warnings()
    assert len(said) == 1 and "shmwatch_segment_bytes" in said[0] and "shmwatch_mount_used_bytes" not in said[0]


def test_lookup_names_the_catalogue():
    assert lookup("shmwatch_mount_usage_ratio").unit == "ratio"
    with pytest.raises(KeyError, match="shmwatch_nope is not in exporter/model/catalogue.py"):
        lookup("shmwatch_nope")


def test_node_labels():
    assert node_labels(lookup("shmwatch_mount_size_bytes")) == NODE_MOUNT_LABELS == ("pod_uid", "volume",
                                                                                       "container_id")
    assert node_labels(lookup("shmwatch_cgroup_memory_usage_bytes")) == ("pod_uid",)
    assert node_labels(lookup("shmwatch_process_shm_bytes")) == NODE_MOUNT_LABELS + ("process_pod_uid",)
    assert node_labels(lookup("shmwatch_build_info")) == ()
    assert node_labels(lookup("shmwatch_sysv_segments")) == ("ipc_namespace", "pod_uid", "container_id")
    assert node_labels(lookup("shmwatch_process_memfd_bytes")) == ("process_pod_uid",)
    # A metric with both a mount and a cgroup label is labelled as a mount's.
    oom = lookup("shmwatch_shm_oom_projection_ratio")
    assert {"mount", "cgroup"} <= set(oom.labels) and node_labels(oom) == NODE_MOUNT_LABELS


def test_catalogue_is_consistent():
    assert len(BY_NAME) == len(CATALOGUE)
    for m in CATALOGUE:
        assert m.type in ("gauge", "counter") and (m.type == "counter") == m.name.endswith("_total"), m.name
        assert m.help.strip(), m.name
