"""How long a stage that just ran waits before it runs again: a bounded share of a core.

Event-driven work (a quick run, a render) under a storm of events could take a core. Each
run's CPU time is followed by `factor` times as much idle, so the stage takes at most
1/(1+factor) of a core. The idle it already had to spare before the run counts towards
that, up to `credit` seconds: a run after a quiet spell (events held for a steady
scraper's next scrape, then a scraper that starts hammering) does not hold the next events
for four times its cost. Idle time counts once: only what came after the last run's own
share, so the bound holds over any stretch longer than `credit`. Idle means outside the
stage's own runs: a source's full run on the same thread (governed by its interval) counts
as spare time for the quick run after it, as it did towards the idle owed before.
"""

from __future__ import annotations

import time
from typing import Callable

# What a stage may bank of its idle time: covers the first run over 15 s of held events at
# a 200-pod node (a quick run ~0.45 s of CPU: 1.8 s owed at four times).
CREDIT_SECONDS = 2.0


class DutyCycle:
    def __init__(
        self,
        factor: float,
        credit: float = CREDIT_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.factor = factor
        self.credit = credit
        self.clock = clock
        self.not_before = 0.0  # monotonic: the stage runs again no sooner

    def ran(self, started: float, cpu_seconds: float) -> None:
        """A run that began at `started` (monotonic) took `cpu_seconds` of CPU and ends now."""
        spare = min(self.credit, max(0.0, started - self.not_before))
        self.not_before = self.clock() + max(0.0, cpu_seconds * self.factor - spare)

    def wait_left(self) -> float:
        return self.not_before - self.clock()
