#!/usr/bin/env python3
"""A walk's traced memory at its peak over files of many names (hard links: up to 50,000 a
file), the first walk and a second one (the listing kept).

    python3 bench/walk_links.py [--links N ...]
Target: the peak does not grow with the names (one is kept per inode while the walk runs).
"""

import argparse
import os
import shutil
import sys
import tempfile
import tracemalloc
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exporter.inventory.walk import Listing, walk  # noqa: E402

PER_FILE = 50_000


def traced_peak(action: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        action()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(links: int) -> None:
    root = tempfile.mkdtemp(prefix="shmwatch-bench-links-")
    try:
        for i in range(links):
            if i % PER_FILE == 0:  # a file of at most PER_FILE names (ext4: 65,000)
                first = os.path.join(root, f"zz_first{i:06d}")
                os.close(os.open(first, os.O_CREAT | os.O_WRONLY, 0o600))
            os.link(first, os.path.join(root, f"psm_{i:06d}"))
        dev, listing = os.stat(root).st_dev, Listing()
        once = traced_peak(lambda: walk(root, dev, listing, 100))
        again = traced_peak(lambda: walk(root, dev, listing, 100))
        print(
            f"{links:>8} names: peak {once / 1024:8.1f} KiB first walk, "
            f"{again / 1024:8.1f} KiB next"
        )
    finally:
        shutil.rmtree(root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--links", type=int, nargs="+", default=[10_000, 65_000])
    for links in parser.parse_args().links:
        measure(links)


if __name__ == "__main__":
    main()
