"""inventory/walk.py: what a listing keeps once a walk finds most of its files gone."""

import os
import sys
from pathlib import Path

from exporter.inventory.walk import Listing, walk
from tests.helpers import make_files


def test_a_walk_that_drops_most_rows_leaves_no_storm_table_to_the_inventories_before(
    tmp_path: Path,
) -> None:
    """The listing gets a table its size, and the one before is emptied at once: the
    inventories of earlier runs share it (MountInventory.listed), and one is held a while
    (the scheduler's last full run until the next, the model's until a scrape), past the
    memory's give-back, with the storm's table."""
    root, names = str(tmp_path), [f"psm_{i:05d}" for i in range(20_000)]
    make_files(root, names)
    dev, listing = os.stat(root).st_dev, Listing()
    walk(root, dev, listing, 100_000)
    shared = listing.rows  # as that run's inventory holds it
    storm = sys.getsizeof(shared)
    for name in names[10:]:
        os.unlink(os.path.join(root, name))
    walk(root, dev, listing, 100_000)
    assert sorted(listing.rows) == names[:10]
    assert sys.getsizeof(listing.rows) * 100 < storm
    assert not shared and sys.getsizeof(shared) * 100 < storm
