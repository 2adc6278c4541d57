"""The sampler keeps to the scrapes when it knows them: sources whose figures nothing keeps
between scrapes run once per scrape, event-driven runs wait for it; with no steady scraper
every source keeps its interval and every event its prompt run."""
import contextlib
import threading
import time

from exporter.runtime.scheduler import Sampler


class Counting:
    """A source that counts its runs (and quick runs)."""

    def __init__(self, name, aligned=False, event_driven=False):
        self.name = name
        self.schedule = "poll"
        self.scrape_aligned = aligned
        self.event_driven = event_driven
        self.runs = []
        self.quick = []
        self.lock = threading.Lock()

    def collect(self):
        with self.lock:
            self.runs.append(time.monotonic())
        return []

    def collect_quick(self):
        with self.lock:
            self.quick.append(time.monotonic())
        return []


def every(period, start):
    """A steady scraper's schedule: scrapes at start + k * period."""
    def due(after=0.0):
        now = max(time.monotonic(), after + 0.01)
        return start + (int((now - start) // period) + 1) * period
    return due


def run_for(sampler, seconds):
    sampler.start()
    try:
        time.sleep(seconds)
    finally:
        sampler.stop()


def test_a_scrape_aligned_source_runs_once_per_scrape():
    aligned, plain, gated = Counting("a", aligned=True), Counting("b"), Counting("c", aligned=lambda: False)
    sampler = Sampler([aligned, plain, gated], poll_interval=0.05)
    sampler.scrape_due = every(1.5, time.monotonic())
    run_for(sampler, 4.0)
    assert len(plain.runs) >= 30 and len(gated.runs) >= 30  # the interval: 0.05 s (80 at most)
    assert 2 <= len(aligned.runs) <= 5, aligned.runs  # about one per 1.5 s scrape


def test_without_a_known_scraper_everything_keeps_its_interval():
    aligned = Counting("a", aligned=True)
    sampler = Sampler([aligned], poll_interval=0.05)
    run_for(sampler, 1.0)
    assert len(aligned.runs) >= 10


def test_event_driven_runs_wait_for_the_scrape_when_one_is_known():
    held, prompt = Counting("held", event_driven=True), Counting("prompt", event_driven=True)
    held.schedule = prompt.schedule = "inventory"
    slow = Sampler([held], poll_interval=0.05, inventory_interval=60)
    fast = Sampler([prompt], poll_interval=0.05, inventory_interval=60)
    start = time.monotonic()
    slow.scrape_due = every(3.0, start)  # the next scrape at start + 3 s; runs held until 2 s
    slow.start()
    fast.start()
    try:
        time.sleep(0.3)  # past the first full runs
        for _ in range(10):
            slow.request_quick()
            fast.request_quick()
            time.sleep(0.1)
        assert not held.quick, "an event-driven run went ahead of the scrape it was held for"
        assert prompt.quick and prompt.quick[0] - start < 1.5
        time.sleep(start + 2.8 - time.monotonic())
        assert len(held.quick) == 1 and held.quick[0] - start >= 1.9  # one run, for all ten events
    finally:
        slow.stop()
        fast.stop()


def test_a_hammering_scraper_ends_the_wait_at_once():
    """A human or a benchmark starts scraping every 25 ms while Prometheus scrapes every
    minute: held runs go ahead, and scrape-aligned sources return to their interval."""
    aligned = Counting("a", aligned=True)
    held = Counting("held", event_driven=True)
    held.schedule = "inventory"
    sampler = Sampler([aligned, held], poll_interval=0.05, inventory_interval=60)
    steady = every(60.0, time.monotonic())
    schedule = {"due": steady}
    sampler.scrape_due = lambda after=0.0: schedule["due"](after)
    sampler.start()
    try:
        time.sleep(0.3)
        runs_while_held = len(aligned.runs)
        sampler.request_quick()
        time.sleep(0.5)
        assert runs_while_held <= 2 and len(aligned.runs) == runs_while_held and not held.quick
        schedule["due"] = lambda after=0.0: None  # the hammering scraper: no schedule
        switched = time.monotonic()
        time.sleep(2.0)
        assert held.quick and held.quick[0] - switched < 1.8  # one look at the schedule, 1 s
        assert len(aligned.runs) >= runs_while_held + 5
    finally:
        sampler.stop()


def test_events_held_for_a_scrape_are_left_to_the_full_run_before_it():
    """A scrape-aligned, event-driven source (node mode's inventory): the events held for a
    scrape are taken by the full run made for that scrape, not by a quick run just before it
    (a slow quick run starts earlier than the full run: node mode read 150 pods twice)."""

    class SlowQuick(Counting):
        def collect_quick(self):
            time.sleep(0.35)  # its lead before a scrape: 4 x 0.35 s, more than a full run's 1 s
            return super().collect_quick()

    both = SlowQuick("both", aligned=True, event_driven=True)
    both.schedule = "inventory"
    sampler = Sampler([both], poll_interval=0.05, inventory_interval=1.0)
    start = time.monotonic()
    sampler.start()
    try:
        sampler.request_quick()  # no scraper known yet: runs at once, and is timed
        time.sleep(start + 0.7 - time.monotonic())
        assert len(both.quick) == 1
        sampler.scrape_due = every(3.0, start)  # scrapes at 3 s, 6 s
        time.sleep(start + 1.15 - time.monotonic())  # past the full run of the interval (1 s)
        runs, quick = len(both.runs), len(both.quick)
        for _ in range(3):
            sampler.request_quick()
            time.sleep(0.05)
        time.sleep(start + 2.8 - time.monotonic())  # the quick run would be due at 1.6 s, the full at 2 s
        assert len(both.quick) == quick, "a quick run went ahead of the full run for the same scrape"
        assert len(both.runs) == runs + 1, both.runs
    finally:
        sampler.stop()


def test_a_storm_of_events_costs_a_bounded_share_of_a_core_not_of_the_clock():
    """Event-driven runs are spaced by four times their CPU time: a run that burns the CPU
    is held back, one that waits (the GIL, a slow disk) is not."""

    class Burns(Counting):
        def collect_quick(self):
            end = time.thread_time() + 0.05
            while time.thread_time() < end:
                pass
            return super().collect_quick()

    class Waits(Counting):
        def collect_quick(self):
            time.sleep(0.05)
            return super().collect_quick()

    burns, waits = Burns("burns", event_driven=True), Waits("waits", event_driven=True)
    burns.schedule = waits.schedule = "inventory"
    sampler = Sampler([burns, waits], poll_interval=0.05, inventory_interval=60)
    sampler.start()
    try:
        time.sleep(0.2)
        stop = time.monotonic() + 2.0
        while time.monotonic() < stop:
            sampler.request_quick()
            time.sleep(0.01)
    finally:
        sampler.stop()
    # 50 ms of CPU, then 200 ms idle: 8 in 2 s, and one more on the idle banked before the
    # storm (duty_cycle.py's credit). Counted in the storm: not the runs at the stop.
    storm = [t for t in burns.quick if t < stop]
    assert len(storm) <= 10, burns.quick
    assert len(waits.quick) >= 12, waits.quick  # 50 ms waiting, then the debounce: ~25 in 2 s


def test_events_are_not_left_to_a_full_run_that_ends_just_before_the_scrape():
    """A source on its own interval (not scrape-aligned) whose full run falls 0.1 s before
    the scrape: the render after it (coalesced 0.1 s) would come after the scrape, and the
    events held for that scrape would miss it. The quick run keeps its lead instead."""
    late = Counting("late", event_driven=True)
    late.schedule = "inventory"
    sampler = Sampler([late], poll_interval=0.05, inventory_interval=1.0)  # full runs at 0, 1, 2 s
    start = time.monotonic()
    sampler.scrape_due = every(2.0, start + 0.1)  # scrapes at 2.1 s, 4.1 s
    sampler.start()
    try:
        time.sleep(start + 1.05 - time.monotonic())  # just after the full run at 1 s
        sampler.request_quick()
        time.sleep(start + 1.9 - time.monotonic())
        assert late.quick, "the events were left to the full run at 2 s, 0.1 s before the scrape"
        assert late.quick[0] - start <= 2.1 - 0.9  # the quick run's lead: 1 s before the scrape
    finally:
        sampler.stop()


def test_a_scrape_gets_one_quick_run_and_later_events_wait_for_the_next():
    """Under churn, every burst in the last second before a scrape ran its own quick run (a
    node: 2.5 a scrape, each reading the changed pods). One quick run per scrape; events
    after it are the next scrape's, or its follow-up full run's."""
    held = Counting("held", event_driven=True)
    held.schedule = "inventory"
    sampler = Sampler([held], poll_interval=0.05, inventory_interval=60)
    start = time.monotonic()
    sampler.scrape_due = every(2.0, start)  # scrapes at 2, 4 s: quick runs held until 1, 3 s
    sampler.start()
    try:
        time.sleep(start + 1.2 - time.monotonic())
        full_before = len(held.runs)
        sampler.request_quick()  # in the scrape's lead: runs at once, for the scrape at 2 s
        time.sleep(start + 1.5 - time.monotonic())
        for _ in range(3):
            sampler.request_quick()
            time.sleep(0.1)
        time.sleep(start + 2.5 - time.monotonic())
        assert len(held.quick) == 1, [q - start for q in held.quick]
        time.sleep(start + 3.6 - time.monotonic())
        # Taken by the first quick run's follow-up full run (1 s after it), not by a quick run.
        assert len(held.quick) == 1 and len(held.runs) == full_before + 1, [q - start for q in held.quick]
    finally:
        sampler.stop()


def test_events_held_for_the_next_scrape_do_not_put_off_the_follow_up_full_run():
    """A quick run's follow-up full run (owners from /proc, 1 s later) still runs while
    later events are held for the next scrape."""
    held = Counting("held", event_driven=True)
    held.schedule = "inventory"
    sampler = Sampler([held], poll_interval=0.05, inventory_interval=60)
    start = time.monotonic()
    sampler.scrape_due = every(3.0, start)  # scrapes at 3, 6 s
    sampler.start()
    try:
        time.sleep(0.3)
        full_before = len(held.runs)
        sampler.request_quick()  # held until 2 s; its follow-up at about 3 s
        time.sleep(start + 2.4 - time.monotonic())
        assert len(held.quick) == 1
        sampler.request_quick()  # after the quick run made for the scrape at 3 s: held for 6 s
        time.sleep(start + 4.0 - time.monotonic())
        assert len(held.runs) == full_before + 1, "the follow-up full run was put off"
    finally:
        sampler.stop()


class LongFullRun(Counting):
    """A full run that reads /proc for a while (a node's full scan), calling the sampler's
    interim hook between processes as the owner scan does."""

    interim_hook = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.published = []  # (full, when)
        self.given_back = False

    def collect(self):
        super().collect()
        end = time.monotonic() + 0.6
        while time.monotonic() < end:
            self.interim_hook()
            time.sleep(0.002)
        return []

    def collect_interim(self):
        self.given_back = True  # the collector gives the names back for the quick run after
        return []

    def changes_pending(self):
        given_back, self.given_back = self.given_back, False
        return given_back

    def observe(self, obs):
        self.published.append((obs.full, time.monotonic()))


def test_events_during_a_long_full_run_are_published_before_it_ends():
    """With no steady scraper, an event during a full run is published by an interim run
    within the debounce, not after the whole run; a quick run follows the full run (owners)."""
    long = LongFullRun("long", event_driven=True)
    long.schedule = "inventory"
    sampler = Sampler([long], poll_interval=0.05, inventory_interval=60)
    sampler.subscribe(long.observe)
    start = time.monotonic()
    sampler.start()
    try:
        time.sleep(0.1)
        sampler.request_quick()
        time.sleep(start + 1.0 - time.monotonic())
    finally:
        sampler.stop()
    assert [full for full, _ in long.published] == [False, True, False], long.published
    interim_at = long.published[0][1]
    assert interim_at - start < 0.3, "the event waited for the full run"
    assert len(long.quick) == 1, "no quick run after the full run for the interim run's names"


def test_a_steady_scraper_gets_no_interim_runs():
    """With a steady scraper the events wait for the run made for its scrape, as before."""
    long = LongFullRun("long", event_driven=True)
    long.schedule = "inventory"
    sampler = Sampler([long], poll_interval=0.05, inventory_interval=60)
    sampler.subscribe(long.observe)
    sampler.scrape_due = every(30.0, time.monotonic())
    sampler.start()
    try:
        time.sleep(0.1)
        sampler.request_quick()
        time.sleep(0.8)
    finally:
        sampler.stop()
    assert [full for full, _ in long.published] == [True], long.published


def test_a_held_run_runs_as_soon_as_a_scrape_ends_the_schedule():
    """Events held for a steady scraper's scrape run when a scrape ends the schedule (a
    scraper hammering), not at the hold's next one-second slice."""
    held = Counting("held", event_driven=True)
    held.schedule = "inventory"
    sampler = Sampler([held], poll_interval=0.05, inventory_interval=60)
    sampler.scrape_due = every(30.0, time.monotonic() + 20)
    sampler.start()
    try:
        time.sleep(0.3)
        sampler.request_quick()
        time.sleep(0.3)
        assert held.quick == [], "not held for the scrape"
        sampler.scrape_due = lambda after=0.0: None
        ended = time.monotonic()
        sampler.schedule_ended()
        deadline = time.monotonic() + 2
        while not held.quick and time.monotonic() < deadline:
            time.sleep(0.005)
        assert held.quick and held.quick[0] - ended < 0.3, "the held run waited for its slice"
    finally:
        sampler.stop()


def test_a_duty_cycle_counts_the_idle_before_a_run_once_and_bounds_the_share_of_a_core():
    """A run after a quiet spell (events held for a scrape) owes no hold for what that
    spell already paid; runs back to back owe four times their CPU time each; and however
    runs fall, their CPU stays within 1/(1+factor) of the time, less one credit."""
    import random

    from exporter.runtime.duty_cycle import DutyCycle

    now = [100.0]
    duty = DutyCycle(4.0, credit=2.0, clock=lambda: now[0])
    now[0] += 0.45
    duty.ran(100.0, 0.45)  # 0.45 s of CPU after 100 s of quiet: 1.8 s owed, all spared before
    assert duty.wait_left() == 0.0
    now[0] += 0.05
    duty.ran(now[0] - 0.05, 0.05)  # straight after: nothing spare, 0.2 s owed
    assert abs(duty.wait_left() - 0.2) < 1e-9
    now[0] += 100.6  # 100 s of quiet, then a run of 0.6 s
    duty.ran(now[0] - 0.6, 0.6)  # after 100 s of quiet: 2.4 s owed, of which the credit pays 2 s only
    assert abs(duty.wait_left() - 0.4) < 1e-9
    rng, start, busy = random.Random(7), now[0], 0.0
    for _ in range(2000):  # runs as soon as allowed, or later, of random cost
        now[0] = max(now[0], duty.not_before) + rng.choice([0.0, 0.0, rng.uniform(0, 0.3)])
        began, cpu = now[0], rng.uniform(0.001, 0.2)
        now[0] += cpu
        busy += cpu
        duty.ran(began, cpu)
    assert busy <= (now[0] - start) / 5.0 + 2.0


def test_stopping_ends_a_duty_wait_without_a_last_quick_run():
    """Events that wait out a run's duty cycle when the sampler stops are dropped: the stop
    ended the wait, and a run then (a node's 0.45 s) held up the stop, over the duty cycle."""

    class Burns(Counting):
        started = []

        def collect_quick(self):
            self.started.append(time.monotonic())
            end = time.thread_time() + 0.1
            while time.thread_time() < end:
                pass
            return super().collect_quick()

    burns = Burns("burns", event_driven=True)
    burns.schedule = "inventory"
    sampler = Sampler([burns], poll_interval=0.05, inventory_interval=60)
    sampler.start()
    try:
        time.sleep(0.2)
        deadline = time.monotonic() + 5.0
        while len(burns.quick) < 3 and time.monotonic() < deadline:  # past the credit: 0.4 s owed
            sampler.request_quick()
            time.sleep(0.01)
        assert len(burns.quick) >= 3, "no storm of quick runs"
        sampler.request_quick()
        time.sleep(0.15)  # the debounce is over: the runner waits out the 0.4 s it owes
    finally:
        stopped = time.monotonic()
        sampler.stop()
    assert all(t < stopped for t in burns.started), (stopped, burns.started)


class PodScoped(Counting):
    """Node mode: a quick run that reads the changed pods' processes (burns 60 ms of CPU),
    and the early publish the sampler makes before it (collect_interim(early=True))."""

    pod_of_pid = True
    interim_hook = None

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.published = []  # (kind, settling, when)

    def collect_quick(self):
        end = time.thread_time() + 0.06
        while time.thread_time() < end:
            pass
        return super().collect_quick()

    def collect_interim(self, early=False):
        assert early, "no full run is under way"
        return ["patched"]

    def observe(self, obs):
        kind = "full" if obs.full else "early" if obs.result == ["patched"] else "quick"
        self.published.append((kind, obs.settling, time.monotonic()))


@contextlib.contextmanager
def sampling(kind):
    """A sampler running one event-driven `kind` of source, its observations recorded."""
    source = kind("scoped", event_driven=True)
    source.schedule = "inventory"
    sampler = Sampler([source], poll_interval=0.05, inventory_interval=60)
    sampler.subscribe(source.observe)
    sampler.start()
    try:
        yield source, sampler
    finally:
        sampler.stop()


def test_a_pod_scoped_quick_run_is_preceded_by_an_early_publish_it_then_settles():
    """With no steady scraper, the names of an event are published before the quick run
    reads their pods; that run then settles them (not urgent for the render). While the
    duty cycle holds the next run, each burst is published early at once."""
    with sampling(PodScoped) as (scoped, sampler):
        time.sleep(0.15)
        asked = time.monotonic()
        sampler.request_quick()
        time.sleep(0.12)  # the first run, after a quiet spell, owes no hold (duty_cycle.py)
        sampler.request_quick()
        time.sleep(0.1)  # the second, straight after it, holds the next for ~0.2 s
        third = time.monotonic()
        sampler.request_quick()
        time.sleep(0.06)
        fourth = time.monotonic()  # in the same hold, after the third's early publish
        sampler.request_quick()
        time.sleep(0.5)
    kinds = [(kind, settling) for kind, settling, _ in scoped.published if kind != "full"]
    assert kinds[:7] == [("early", False), ("quick", True)] * 2 + [("early", False)] * 2 + [("quick", True)], \
        scoped.published
    early = [when for kind, _, when in scoped.published if kind == "early"]
    quick = [when for kind, _, when in scoped.published if kind == "quick"]
    assert early[0] - asked < 0.1 and early[0] < quick[0]
    # The third burst, under the second run's duty cycle: published early within the
    # debounce, its quick run after the hold.
    assert early[2] - third < 0.15 and quick[2] - third > 0.12 and early[2] < quick[2]
    assert early[3] - fourth < 0.1 and early[3] < quick[2]  # one quick run settles both bursts


class PartlyPatched(PodScoped):
    """An early publish that patched one mount but gave another's names back (a new pod's
    mount, not listed by a run yet, or one to re-list whole): the quick run shows those."""

    def changes_pending(self):
        return True


def test_a_quick_run_with_names_the_early_publish_could_not_patch_is_urgent():
    """Names nobody has seen yet make the quick run urgent for the render, not settling."""
    with sampling(PartlyPatched) as (scoped, sampler):
        time.sleep(0.15)
        sampler.request_quick()
        time.sleep(0.3)
    kinds = [(kind, settling) for kind, settling, _ in scoped.published if kind != "full"]
    assert kinds[:2] == [("early", False), ("quick", False)], scoped.published
