"""The cyclic garbage collector, tuned for a process whose objects die by reference counting.

CPython collects its youngest generation each time 700 more container objects have been
made than freed. A node's render or owner scan makes tens of thousands for a moment, so
with that default the collector ran 30 times a second, and every 4 s traversed the whole
heap (100,000 objects: 50-120 ms during which no thread runs, detection included). In a
120 s churn at 200 pods (3,952 collections) it found no garbage at all, and cost 4.7 % of
a core. So it runs only after GEN0_THRESHOLD net new objects: a steady state that makes and
frees its objects, cycles or not, rarely reaches it, while garbage cycles still end in a
collection once that many pile up. tests/test_gc_tuning.py checks that serving, as a
sidecar and as a node, makes none (it found SysV's setns making some: fixed in sysv.py).
"""

from __future__ import annotations

import gc

GEN0_THRESHOLD = 50_000


def tune() -> None:
    """For the exporter's own process (serve), not for a library user's."""
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(GEN0_THRESHOLD, gen1, gen2)
