"""model/catalogue.py: the families, their defaults, and what --metric-allowlist and
--metric-denylist make of them."""

import re

import pytest

from exporter.model.catalogue import BY_NAME, CATALOGUE, DEFAULT_SET, exposed_families, unmatched


def test_rows_are_consistent():
    assert len(BY_NAME) == len(CATALOGUE)
    for m in CATALOGUE:
        base = m.name.removesuffix("_total")
        assert m.type == ("gauge" if base == m.name else "counter"), m.name
        assert m.unit == next((u for u in ("bytes", "seconds", "ratio") if base.endswith("_" + u)), ""), m.name
        assert m.help and not m.help.endswith(" ") and "  " not in m.help, m.name
        assert isinstance(m.default, bool), m.name
    assert DEFAULT_SET == {m.name for m in CATALOGUE if m.default}


def test_no_default_family_names_a_pid():
    """A pid is a label of no family, default or not: a series per restart."""
    assert not [m.name for m in CATALOGUE if "pid" in m.labels]


def test_the_default_set_without_flags():
    assert exposed_families((), ()) == DEFAULT_SET
    assert "shmwatch_mount_usage_ratio" not in DEFAULT_SET and "shmwatch_mount_used_bytes" in DEFAULT_SET


def test_a_denylist_takes_families_out_of_the_default_set_only():
    denied = exposed_families((), ("shmwatch_mount_.*_bytes", "shmwatch_segment_events"))
    assert denied == DEFAULT_SET - {n for n in DEFAULT_SET if re.fullmatch("shmwatch_mount_.*_bytes", n)} - {
        "shmwatch_segment_events_total"}
    assert "shmwatch_mount_inodes" not in denied  # opt-in stays out
    # Anchored: a pattern matches a whole name, never a part of one.
    assert exposed_families((), ("mount",)) == DEFAULT_SET
    assert exposed_families((), ("shmwatch_mount_size",)) == DEFAULT_SET


def test_an_allowlist_exposes_exactly_its_families_opt_in_ones_too():
    assert exposed_families(("shmwatch_mount_inodes.*",), ()) == {"shmwatch_mount_inodes", "shmwatch_mount_inodes_free"}
    assert exposed_families((".*",), ()) == set(BY_NAME)
    # A counter by its family name (without _total) or its sample name.
    assert exposed_families(("shmwatch_cgroup_oom_kills",), ()) == {"shmwatch_cgroup_oom_kills_total"}
    assert exposed_families(("shmwatch_cgroup_oom_kills_total",), ()) == {"shmwatch_cgroup_oom_kills_total"}
    assert exposed_families(("shmwatch_mount",), ()) == frozenset()


@pytest.mark.parametrize("pattern,matches", [
    ("shmwatch_mount_size_bytes", True), ("shmwatch_.*", True), ("shmwatch_segment_events", True),
    ("nope", False), ("shmwatch_mount_size_bytes,shmwatch_mount_used_bytes", False), ("shmwatch_mount", False),
])
def test_a_pattern_that_matches_no_family_is_found(pattern, matches):
    assert unmatched((pattern,)) == (() if matches else (pattern,))
