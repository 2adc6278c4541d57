"""model/state.py: what outlives one observation per mount. The peak window's maximum
slides; a high-water mark keeps when it was first reached; another mount instance at a
path starts both afresh; a mount found gone takes no sample; a forgotten mount takes its
counters with it; `version` moves with every change and only then."""

from typing import List

from exporter.model.state import PeakWindow, StateStore
from exporter.model.types import MountInstance, MountUsage


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_the_peak_window_is_the_highest_sample_within_it() -> None:
    window = PeakWindow(10.0)
    assert window.peak(0.0) is None
    window.add(0.0, 500)
    window.add(1.0, 100)
    window.add(2.0, 300)
    assert window.peak(5.0) == 500
    assert window.peak(10.5) == 300  # 500 fell out, the next highest left
    assert window.peak(12.5) == 300  # the latest stays, however old, when none is newer


def test_the_peak_window_keeps_only_falling_samples() -> None:
    window = PeakWindow(60.0)
    for t, value in enumerate([1, 2, 3, 4, 5]):
        window.add(float(t), value)
    assert window.peak(5.0) == 5
    window.add(6.0, 1)
    assert window.peak(6.0) == 5 and window.peak(65.0) == 1


def usage(used: int, instance: object = None, error: object = None) -> MountUsage:
    return MountUsage(mount="/m", fstype="tmpfs", source="shm", is_mount_point=True,
                      used_bytes=used, instance=instance, error=error)  # type: ignore[arg-type]


def test_the_high_water_mark_keeps_when_it_was_first_reached() -> None:
    wall = Clock(50.0)
    store = StateStore(clock=Clock(), wall_clock=wall)
    store.record_polled([usage(100)])
    wall.now = 60.0
    store.record_polled([usage(100)])  # reached again, not higher
    wall.now = 70.0
    store.record_used("/m", 80)
    high = store.snapshot().max_used["/m"]
    assert (high.used_bytes, high.at) == (100, 50.0)
    store.record_used("/m", 101)
    assert store.snapshot().max_used["/m"].at == 70.0


def test_another_instance_starts_the_peak_afresh_an_error_does_not() -> None:
    clock = Clock()
    store = StateStore(peak_window=60.0, clock=clock)
    first = MountInstance(device="0:50", mount_id=3, unique_id=10)
    store.record_polled([usage(900, first)])
    store.record_polled([usage(0, first, error="Input/output error")])  # the same mount, for now
    assert store.snapshot().peaks["/m"] == 900
    store.record_polled([usage(200, MountInstance(device="0:50", mount_id=3, unique_id=11))])
    states = store.snapshot()
    assert states.peaks["/m"] == 200 and states.max_used["/m"].used_bytes == 200


def test_a_mount_found_gone_takes_no_sample_from_the_watcher() -> None:
    """Its statvfs would measure the disk beneath."""
    store = StateStore(clock=Clock())
    store.record_polled([usage(100, MountInstance(device="0:50", mount_id=3))])
    store.record_polled([usage(0, error="not a mount point")])
    store.record_used("/m", 10**12)
    states = store.snapshot()
    assert "/m" not in states.max_used and "/m" not in states.peaks  # gone: another mount next
    store.record_polled([usage(5, MountInstance(device="0:51", mount_id=4))])  # mounted again
    store.record_used("/m", 7)
    assert store.snapshot().max_used["/m"].used_bytes == 7  # a new mount: started afresh


def test_events_overflows_and_inotify_in_a_snapshot() -> None:
    store = StateStore(clock=Clock())
    store.count_event("/m", "nccl", "deleted", 2)
    store.count_event("/m", "nccl", "created")
    store.count_event("/m", "mpi", "created")
    store.count_overflow("/m")
    store.count_overflow("/m")
    store.set_inotify("/m", True)
    store.set_inotify("/n", False)
    states = store.snapshot()
    assert states.event_rows == {"/m": (("mpi", "created", 1), ("nccl", "created", 1), ("nccl", "deleted", 2))}
    assert states.overflows == {"/m": 2}
    assert states.inotify == {"/m": True, "/n": False}
    assert store.inotify_active("/m") and not store.inotify_active("/n")
    assert not store.inotify_active("/never")


def test_the_version_moves_with_a_change_and_only_then() -> None:
    store = StateStore(clock=Clock())
    versions: List[int] = [store.version()]

    def moved() -> bool:
        versions.append(store.version())
        return versions[-1] != versions[-2]

    store.set_inotify("/m", True)
    assert moved()
    store.set_inotify("/m", True)  # said again: nothing changed
    assert not moved()
    store.snapshot()
    assert not moved()
    store.count_event("/m", "nccl", "created")
    assert moved()
    store.forget_mounts_except(["/m"])
    assert not moved()
    store.forget_mounts_except([])
    assert moved()


def test_a_forgotten_mount_takes_its_peaks_counters_and_flags_with_it() -> None:
    store = StateStore(clock=Clock())
    for mount in ("/pod-a", "/pod-b"):
        store.record_used(mount, 10)
        store.count_event(mount, "nccl", "created")
        store.count_overflow(mount)
        store.set_inotify(mount, True)
    store.forget_mounts_except(["/pod-b"])
    states = store.snapshot()
    for per_mount in (states.peaks, states.max_used, states.event_rows, states.inotify, states.overflows):
        assert set(per_mount) == {"/pod-b"}


# --- mounts polled gone, or as another instance ---------------------------------------------
def test_a_mount_polled_gone_takes_no_samples_until_it_is_back():
    """Gone: its peak and high-water mark start afresh, and the watcher's samples (the disk
    beneath) are dropped until a poll finds it again; a passing error on the same instance
    or an unknown instance keeps them."""
    now = [100.0]
    store = StateStore(peak_window=60.0, clock=lambda: now[0], wall_clock=lambda: 5000.0)

    def usage(used=0, instance=None, error=None):
        return MountUsage("/m", "tmpfs", "shm", True, error=error, used_bytes=used, instance=instance)

    def snap():
        s = store.snapshot()
        high = s.max_used.get("/m")
        return s.peaks.get("/m"), high and (high.used_bytes, high.at)

    first = MountInstance(device="0:42", mount_id=7)
    store.record_polled([usage(900, first), usage(50, first)])
    assert snap() == (900, (900, 5000.0))
    store.record_polled([usage(error="Input/output error", instance=first)])
    store.record_used("/m", 300)
    assert snap() == (900, (900, 5000.0))  # the same mount, still sampled
    store.record_polled([usage(error="not a mount point")])
    assert snap() == (None, None)
    store.record_used("/m", 700)
    assert snap() == (None, None)  # the disk beneath: not sampled
    store.record_polled([usage(200, MountInstance(device="0:43", mount_id=8))])
    assert snap() == (200, (200, 5000.0))  # back, another instance
    store.record_used("/m", 250)
    assert snap() == (250, (250, 5000.0))
    store.record_polled([usage(100)])  # the table could not say: proves nothing
    assert snap() == (250, (250, 5000.0))
    store.record_polled([usage(100, MountInstance(device="0:43", mount_id=8))])
    assert snap() == (250, (250, 5000.0))
