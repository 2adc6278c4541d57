#!/usr/bin/env python3
"""Inventory cycle time at 10,000 segments x 300 processes (run as root: it mounts tmpfs).

Builds a tmpfs with 10,000 segments (4 KiB each, mixed classes), starts 300 real
processes (bench/map_hold.c) that each map 10 of them, then times full inventories
(directory + every /proc/<pid>/maps and fd) and event-driven quick ones (directory only).

    sudo python3 bench/inventory.py [--segments N] [--processes N]
Target: full cycle <= 200 ms on one core.
"""
import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exporter.collectors.segments import SegmentsCollector  # noqa: E402
from exporter.collectors.source import RunInput  # noqa: E402
from exporter.host.paths import Paths  # noqa: E402
from tests.conftest import mounted_tmpfs  # noqa: E402

PREFIXES = ("nccl-", "psm_", "torch_", "ucx_shm_posix_", "sem.", "vader_segment.", "plasma", "misc")


def build(shm: str, count: int):
    names = []
    for i in range(count):
        name = f"{PREFIXES[i % len(PREFIXES)]}{i:06d}"
        fd = os.open(os.path.join(shm, name), os.O_CREAT | os.O_RDWR, 0o600)
        os.posix_fallocate(fd, 0, 4096)
        os.close(fd)
        names.append(name)
    return names


def start_holders(shm, names, processes, per_process, workdir):
    binary = os.path.join(workdir, "map_hold")
    subprocess.run(["gcc", "-O1", "-o", binary, os.path.join(os.path.dirname(__file__), "map_hold.c")], check=True)
    holders = []
    for p in range(processes):
        files = [os.path.join(shm, names[(p * per_process + k) % len(names)]) for k in range(per_process)]
        proc = subprocess.Popen([binary, *files], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        holders.append(proc)
    for proc in holders:
        assert proc.stdout.readline() == b"ready\n"
    return holders


def timed(fn, runs):
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - started)
    return times, result


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--segments", type=int, default=10000)
    parser.add_argument("--processes", type=int, default=300)
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs")
    with tempfile.TemporaryDirectory() as work, mounted_tmpfs("256m") as shm:
        names = build(shm, args.segments)
        holders = start_holders(shm, names, args.processes, 10, work)
        try:
            collector, run = SegmentsCollector(Paths()), RunInput(mounts=(shm,))
            collector.collect(run)  # warm caches, as a running exporter's are
            cpu_started = time.process_time()
            full, inv = timed(lambda: collector.collect(run), args.runs)
            cpu = (time.process_time() - cpu_started) / args.runs  # one run's, on average
            def one_event():
                # What a quick run does after inotify reports one new segment.
                name = f"nccl-bench{time.monotonic_ns()}"
                fd = os.open(os.path.join(shm, name), os.O_CREAT | os.O_RDWR, 0o600)
                os.close(fd)
                return collector.collect_quick(RunInput(mounts=(shm,), changes={shm: {name}}))

            quick, _ = timed(one_event, args.runs)
        finally:
            for proc in holders:
                proc.stdin.close()
            for proc in holders:
                proc.wait()
    m = inv.mounts[0]
    states = {}
    for seg in m.rows():
        states[seg.state] = states.get(seg.state, 0) + 1
    print(f"inventory of {sum(states.values()):,} segments ({states}) with {inv.processes_scanned} processes scanned:")
    print(f"  full  (directory + /proc maps and fds): median {statistics.median(full) * 1000:.0f} ms, "
          f"max {max(full) * 1000:.0f} ms, CPU {cpu * 1000:.0f} ms (target <= 200 ms)")
    print(f"  quick (the one segment inotify reported): median {statistics.median(quick) * 1000:.0f} ms, "
          f"max {max(quick) * 1000:.0f} ms")


if __name__ == "__main__":
    main()
