"""runtime/memory.py: when the heap is given back after the segment inventory shrank."""

import gc
import weakref
from typing import Callable, List, Optional, Tuple

from exporter.app import App
from exporter.config import parse_args
from exporter.model.types import ClassTotals, Inventory, MountInventory, Observation
from exporter.model.types import PackedRow
from exporter.runtime.memory import AGAIN, SETTLE_SECONDS, SHRUNK, MemoryGiveBack


def inventory(*counts: int, degraded: Optional[int] = None) -> Inventory:
    """Mounts /x, /y, ... listing `counts` rows; `degraded`: /x counted past the cap instead."""
    mounts = [
        MountInventory(
            f"/{m}",
            names=tuple(f"f{i}" for i in range(n)),
            packed=(PackedRow(0),) * n,
            states=bytes(n),
        )
        for m, n in zip("xyz", counts)
    ]
    if degraded is not None:
        mounts[0] = MountInventory(
            "/x", degraded={"python_shm": ClassTotals(count=degraded)}
        )
    return Inventory(mounts, {}, 0, 0)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def give_back() -> Tuple[MemoryGiveBack, List[float], Clock]:
    released: List[float] = []
    clock = Clock()
    return (
        MemoryGiveBack(lambda: released.append(clock.now), clock=clock),
        released,
        clock,
    )


def feeder(subscriber: MemoryGiveBack, released: List[float]) -> Callable[..., int]:
    """-> accept(result, error, full): the give-backs so far after publishing that run."""

    def accept(
        result: Optional[Inventory], error: Optional[str] = None, full: bool = True
    ) -> int:
        subscriber.on_observation(Observation("segments", result, error, 0.0, full))
        return len(released)

    return accept


def test_given_back_once_the_files_listed_fall_by_many_since_the_last_give_back() -> (
    None
):
    """A storm deleted over many quick runs, each fewer than SHRUNK, is given back too; a
    failed run counts nothing; a mount gone counts as its files gone."""
    assert SHRUNK == 10_000
    subscriber, released, _ = give_back()
    accept = feeder(subscriber, released)
    big = inventory(6_000, 6_000)
    assert accept(big) == 0
    assert accept(inventory(6_000, 100)) == 0  # 5,900 fewer
    assert accept(big) == 0
    assert (
        accept(inventory(1_000, 1_000), full=False) == 1
    )  # 10,000 fewer than the most
    assert accept(None, error="timed out") == 1
    assert accept(inventory(100, 100)) == 1  # 1,800 fewer than at the give-back
    assert accept(big) == 1
    for n in (4_000, 2_500, 1_001):  # gone by a few thousand at a time
        assert accept(inventory(n, n), full=False) == 1
    assert (
        accept(inventory(1_000, 1_000), full=False) == 2
    )  # 10,000 fewer than the most
    assert accept(inventory(1, 0), full=False) == 2
    gone = MountInventory("/y", error="gone")
    assert accept(Inventory([big.mounts[0], gone], {}, 0, 0)) == 2  # 6,000 more
    assert accept(big) == 2
    assert (
        accept(Inventory([gone], {}, 0, 0)) == 3
    )  # one mount gone, the other not listed


def test_files_counted_past_the_cap_count_as_listed() -> None:
    """A storm past --inventory.max-segments keeps counts, not rows: its deletion is a
    shrink all the same (the model's trigger counted rows only: 300,000 files gone gave
    nothing back)."""
    subscriber, released, _ = give_back()
    accept = feeder(subscriber, released)
    assert accept(inventory(0, degraded=250_000)) == 0
    assert accept(inventory(0, degraded=200_000)) == 1
    assert accept(inventory(0)) == 2


def test_given_back_again_on_later_runs_once_the_storm_settled() -> None:
    """What is freed after a storm's last give-back (inotify events still queued, the
    inventories and renders before) is given back on AGAIN later runs, each SETTLE_SECONDS
    after the one before; a run sooner, or once they are spent, gives nothing back."""
    subscriber, released, clock = give_back()
    accept = feeder(subscriber, released)
    accept(inventory(20_000))
    assert accept(inventory(0)) == 1
    shrank_at = clock.now
    clock.now += SETTLE_SECONDS - 1
    assert accept(inventory(0)) == 1  # too soon
    for n in range(AGAIN):
        clock.now += 1
        assert accept(inventory(0)) == 2 + n
        assert accept(inventory(0)) == 2 + n  # the same moment: once
        clock.now += SETTLE_SECONDS - 1
    clock.now += 3600
    assert accept(inventory(0)) == 1 + AGAIN  # spent
    assert released == [shrank_at + SETTLE_SECONDS * k for k in range(AGAIN + 1)]
    # Another storm: given back at once, and settled again.
    accept(inventory(30_000))
    assert accept(inventory(5_000)) == 2 + AGAIN
    clock.now += SETTLE_SECONDS
    assert accept(inventory(5_000)) == 3 + AGAIN


def test_only_the_segments_source_counts() -> None:
    subscriber, released, _ = give_back()
    subscriber.on_observation(Observation("segments", inventory(20_000), None, 0.0))
    subscriber.on_observation(Observation("sysv", [], None, 0.0))
    subscriber.on_observation(Observation("segments", inventory(0), None, 0.0))
    assert len(released) == 1


def test_the_app_gives_back_after_the_model_dropped_the_inventory_before(
    tmp_path: str,
) -> None:
    """App subscribes the give-back after the model step: when memory is given back, the
    inventory before is freed already (nothing here holds it)."""
    app = App(parse_args([f"--shm.mount={tmp_path}", "--no-collector.gpu"]))
    before: List[Callable[[], object]] = [lambda: None]  # the inventory before, weakly
    freed: List[bool] = []
    app.give_back.release = lambda: freed.append(before[0]() is None)
    storm = inventory(20_000)
    app.sampler.publish(Observation("segments", storm, None, 0.0))
    before[0] = weakref.ref(storm)
    del storm
    gc.collect()
    app.sampler.publish(Observation("segments", inventory(0), None, 0.0))
    assert freed == [True]
