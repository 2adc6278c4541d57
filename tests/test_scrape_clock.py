"""The next scrape's due time, learned per scraper (pure; a fake clock)."""
from exporter.exposition.scrape_clock import ScrapeClock


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def scrape_every(clock, sc, who, interval, times):
    for _ in range(times):
        sc.scraped(who)
        clock.now += interval
    clock.now -= interval  # back to the last scrape


def test_unknown_until_a_scraper_shows_a_steady_interval():
    clock = Clock()
    sc = ScrapeClock(clock)
    assert sc.next_due() is None
    sc.scraped("prom")
    assert sc.next_due() is None  # one scrape: no interval yet
    clock.now += 15
    sc.scraped("prom")
    assert sc.next_due() is None  # one interval is not yet a steady one
    clock.now += 15
    sc.scraped("prom")
    assert sc.next_due() == clock.now + 15


def ha_pair(clock, sc, first, second, offset, interval=15.0, times=4):
    """Two replicas on the same interval, the second `offset` seconds behind the first."""
    for _ in range(times):
        sc.scraped(first)
        clock.now += offset
        sc.scraped(second)
        clock.now += interval - offset


def test_the_earliest_of_an_ha_pair_is_due_first():
    clock = Clock()
    sc = ScrapeClock(clock)
    ha_pair(clock, sc, "prom-a", "prom-b", 5)
    a_last, b_last = clock.now - 15, clock.now - 10
    assert sc.next_due() == a_last + 15
    # Rendered for a's: the next is b's; rendered for that too: a's one after, then b's.
    assert sc.next_due(after=a_last + 15) == b_last + 15
    assert sc.next_due(after=b_last + 15) == a_last + 30
    clock.now += 20  # a and b are late: their next ones after what was rendered
    assert sc.next_due(after=a_last + 30) == b_last + 30


def test_an_irregular_or_hammering_scraper_means_render_every_change():
    clock = Clock()
    sc = ScrapeClock(clock)
    scrape_every(clock, sc, "prom", 15, 4)
    assert sc.next_due() is not None
    for gap in (1, 7, 3):
        clock.now += gap
        sc.scraped("curl")
    assert sc.next_due() is None  # curl's next scrape cannot be told
    clock = Clock()
    sc = ScrapeClock(clock)
    scrape_every(clock, sc, "bench", 0.025, 20)
    assert sc.next_due() is None  # faster than renders are worth holding for


def test_a_scraper_that_went_away_is_forgotten():
    clock = Clock()
    sc = ScrapeClock(clock)
    scrape_every(clock, sc, "old", 30, 4)
    scrape_every(clock, sc, "new", 15, 4)
    assert sc.next_due() == clock.now - 45 + 30  # "old" last scraped 45 s ago, before "new" is due
    clock.now += 30 * 3 + 1  # "old" silent for more than three of its intervals, "new" too
    assert sc.next_due() is None
    clock.now += 61
    sc.scraped("once")  # a one-off scrape sets no schedule, and is forgotten after a minute
    assert sc.next_due() is None
    clock.now += 61
    scrape_every(clock, sc, "prom", 10, 3)
    assert sc.next_due() == clock.now + 10


def test_a_port_scan_does_not_grow_the_table_without_end():
    clock = Clock()
    sc = ScrapeClock(clock)
    for i in range(1000):
        sc.scraped(f"10.0.{i // 256}.{i % 256} scanner")
    assert len(sc._scrapers) <= 64


def test_a_one_off_scrape_keeps_the_schedule_and_a_burst_is_soon_forgotten():
    """An operator's curl does not end Prometheus's schedule (the stale guard keeps what it
    reads fresh); a readiness loop hammering at start-up stops counting 5 s after it ends."""
    clock = Clock()
    sc = ScrapeClock(clock)
    scrape_every(clock, sc, "prom", 15, 4)
    expected = clock.now + 15
    clock.now += 1
    sc.scraped("curl")
    assert sc.next_due() == expected
    scrape_every(clock, sc, "ready-loop", 0.05, 20)
    assert sc.next_due() is None  # while it hammers, every change renders
    clock.now += 5.1
    assert sc.next_due() == expected


def test_an_ha_replica_a_few_seconds_behind_gets_a_render_of_its_own():
    clock = Clock()
    sc = ScrapeClock(clock)
    ha_pair(clock, sc, "prom-0", "prom-1", 3)
    a_due = clock.now  # prom-0 last scraped 15 s ago
    assert sc.next_due() == a_due
    assert sc.next_due(after=a_due) == a_due + 3  # not taken as served by prom-0's render


def test_a_scrape_that_ends_the_schedule_says_so_once():
    """What waits for a scrape (held renders and runs) is told when a scrape ends the
    schedule: a second scraper's second scrape, 25 ms after its first (a benchmark or a
    human hammering), not its first (a one-off curl keeps the schedule), and only once."""
    clock = Clock()
    sc = ScrapeClock(clock)
    ended = []
    sc.on_unknown(lambda: ended.append(clock.now))
    scrape_every(clock, sc, "prom", 15, 4)
    assert ended == [] and sc.next_due() is not None
    clock.now += 1
    sc.scraped("bench")
    assert ended == []  # one scrape: no schedule of its own yet, and none ended
    for _ in range(5):
        clock.now += 0.025
        sc.scraped("bench")
    assert ended == [1000.0 + 45 + 1 + 0.025] and sc.next_due() is None
