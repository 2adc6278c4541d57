"""The cyclic garbage collector, tuned for a process whose objects die by reference counting:
a node's owner scan makes tens of thousands for a moment, and at the default threshold (700)
the collector runs many times a second finding nothing. tests/test_gc_tuning.py checks that
serving makes no cycles (any would still be collected after GEN0_THRESHOLD)."""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune() -> None:
    """For the exporter's own process (serve), not for a library user's."""
    gc.set_threshold(GEN0_THRESHOLD, *gc.get_threshold()[1:])
