#!/usr/bin/env python3
"""Node mode at scale: 200 pod shm mounts and 2,000 processes (run as root).

Mounts 200 real tmpfs at kubelet emptyDir paths under a temporary root, creates 5
segments in each and a memory cgroup per pod (cgroup v1 here), starts 2,000 real
processes (bench/map_hold.c) that map some of them, then times one full cycle of what
a DaemonSet does on every poll and inventory: discovery + statvfs of every mount, the
segment inventory across all host processes, and every pod's cgroup.

    sudo python3 bench/node_mode.py [--pods 200] [--processes 2000]
"""
import argparse
import os
import signal
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from exporter.collectors.cgroup import CgroupCollector  # noqa: E402
from exporter.collectors.segments import SegmentsCollector  # noqa: E402
from exporter.collectors.shm_mount import ShmMountCollector  # noqa: E402
from exporter.collectors.discovery import MountDiscovery  # noqa: E402
from exporter.collectors.source import RunInput  # noqa: E402
from exporter.host.paths import Paths  # noqa: E402
from node_scale import Pods  # noqa: E402  (bench/ is this script's directory)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pods", type=int, default=200)
    parser.add_argument("--processes", type=int, default=2000)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs and creates cgroups")
    # `timeout` or a CI's cancel: unwind, so the pods' mounts and cgroups are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    with Pods(args.pods) as pods:
        pods.start_processes(args.processes)
        paths = Paths()
        discovery = MountDiscovery(paths, ["/dev/shm"], node_mode=True)
        shm = ShmMountCollector(paths)

        def run():  # what the scheduler hands a run: discovery's last set
            return RunInput(mounts=tuple(discovery.current().mounts()))

        def discover_and_measure():
            discovery.collect()
            return shm.collect(run())
        segments = SegmentsCollector(paths, pod_of_pid=True)
        cgroup = CgroupCollector(paths, node_mode=True)
        times = {"discovery + statvfs": [], "segment inventory": [], "pod cgroups": []}
        for _ in range(args.runs + 1):
            for name, collect in (("discovery + statvfs", discover_and_measure),
                                  ("segment inventory", lambda: segments.collect(run())),
                                  ("pod cgroups", lambda: cgroup.collect(run()))):
                started = time.perf_counter()
                result = collect()
                times[name].append(time.perf_counter() - started)
                if name == "segment inventory":
                    inv = result
        found = len([m for m in discovery.current().mounts() if "/kubelet/pods/" in m])
        held = sum(1 for m in inv.mounts for s in m.rows() if s.state == "linked")
        print(f"node mode: {found} pod mounts discovered, {inv.processes_scanned} processes scanned, "
              f"{held} held segments, {len(cgroup.pod_cgroups())} pod cgroups")
        total = 0.0
        for name, values in times.items():
            med = statistics.median(values[1:])
            total += med
            print(f"  {name:<22} median {med * 1000:6.0f} ms   max {max(values[1:]) * 1000:6.0f} ms")
        print(f"  {'full cycle':<22} median {total * 1000:6.0f} ms")


if __name__ == "__main__":
    main()
