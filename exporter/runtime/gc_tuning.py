"""The cyclic garbage collector, tuned for a process whose objects die by reference counting.

CPython collects its youngest generation each time 700 more container objects have been
made than freed. A node's render or owner scan makes tens of thousands for a moment, so
with that default the collector runs many times a second and often traverses the whole
heap, while finding no garbage: our objects die by reference counting. So it runs only
after GEN0_THRESHOLD net new objects; garbage cycles, should any appear, still end in a
collection once that many pile up. tests/test_gc_tuning.py checks that serving, as a
sidecar and as a node, makes none.
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune() -> None:
    """For the exporter's own process (serve), not for a library user's."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
