"""inventory/walk.py: what a listing keeps once a walk finds most of its files gone."""

import os
import sys
from pathlib import Path

from exporter.inventory.walk import Listing, walk
from tests.conftest import needs_root
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


@needs_root
def test_a_file_of_two_names_is_listed_under_the_smaller_whatever_the_directory_order(
    tmpfs: str,
) -> None:
    """A hard-linked file is listed once, under the smaller of its names: its class (and so
    `check`'s rm advice) does not depend on the order the directory is read in. (It was the
    first name the walk met: tmpfs lists the newest entry first, so the link made last.)"""
    from exporter.model.types import Row

    for order in (("psm_data", "zz_link"), ("zz_link", "psm_data")):
        root = Path(tmpfs) / order[0]
        root.mkdir()
        first, second = (str(root / name) for name in order)
        with open(first, "wb") as f:
            f.write(b"x" * 4096)
        os.link(first, second)
        listing = Listing()
        walk(str(root), os.stat(root).st_dev, listing, 100)
        assert list(listing.rows) == ["psm_data"], order
        assert Row.class_name(listing.rows["psm_data"]) == "python_shm"
        assert Row.inode(listing.rows["psm_data"]) == os.stat(first).st_ino


def test_a_patch_lists_a_file_of_two_names_under_the_smaller(tmp_path: Path) -> None:
    """inotify names a link made to a listed file: the smaller name takes its row (a rename's
    events), a greater one is not listed."""
    from exporter.inventory.walk import patch_listing

    root = str(tmp_path)
    dev = os.stat(root).st_dev
    with open(os.path.join(root, "zz_first"), "wb") as f:
        f.write(b"x" * 4096)
    listing = Listing()
    walk(root, dev, listing, 100)
    os.link(os.path.join(root, "zz_first"), os.path.join(root, "zz_later"))
    assert patch_listing(root, dev, listing, ["zz_later"]) == {}
    assert list(listing.rows) == ["zz_first"]
    os.link(os.path.join(root, "zz_first"), os.path.join(root, "psm_named"))
    events = patch_listing(root, dev, listing, ["psm_named"])
    assert list(listing.rows) == ["psm_named"]
    assert events == {("other", "deleted"): 1, ("python_shm", "created"): 1}
    walk(root, dev, listing, 100)  # and a walk agrees
    assert list(listing.rows) == ["psm_named"]
