#!/usr/bin/env python3
"""Detection latency and peak capture (run as root: it mounts tmpfs).

1. 100 times: create a 4 MiB fallocate'd nccl-XXXXXX file and time until a scrape of
   /metrics shows it (segment count and bytes); print p50 / p99 (target p99 <= 1 s: the
   first scrape after the debounced event-driven run).
2. A 2 s fill of a 32 MiB tmpfs to 90 % and back, with no scrape during it; then read
   shmwatch_mount_peak_used_bytes (target >= 90 %).

    sudo python3 bench/detection.py
"""
import os
import random
import string
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import Exporter, fallocate, mounted_tmpfs, value  # noqa: E402

MiB = 1 << 20


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def detection(shm, exporter, runs=100):
    latencies = []
    for i in range(runs):
        name = "nccl-" + "".join(random.choices(string.ascii_letters + string.digits, k=6))
        started = time.monotonic()
        fallocate(os.path.join(shm, name), 4 * MiB)
        while True:
            s = exporter.scrape()
            count = sum(v for (n, ls), v in s.items() if n == "shmwatch_segments" and dict(ls).get("class") == "nccl")
            size = sum(v for (n, ls), v in s.items() if n == "shmwatch_segment_bytes"
                       and dict(ls).get("class") == "nccl")
            if count == 1 and size == 4 * MiB:
                break
            if time.monotonic() - started > 5:
                raise TimeoutError(f"run {i}: not seen in 5 s")
        latencies.append(time.monotonic() - started)
        os.unlink(os.path.join(shm, name))
        while any(v for (n, ls), v in exporter.scrape().items()
                  if n == "shmwatch_segments" and dict(ls).get("class") == "nccl"):
            time.sleep(0.005)
    return latencies


def spike(shm, exporter):
    size = os.statvfs(shm).f_blocks * os.statvfs(shm).f_frsize
    target = int(size * 0.9)
    path = os.path.join(shm, "nccl-spike0")
    chunk = b"\1" * MiB
    started = time.monotonic()
    with open(path, "wb") as f:  # 2 s: fill to 90 % over one second, hold, then free
        written = 0
        while written < target:
            f.write(chunk)
            f.flush()
            written += MiB
            time.sleep(1.0 / (target // MiB))
    time.sleep(max(0.0, 2.0 - (time.monotonic() - started)))
    os.unlink(path)
    time.sleep(0.5)
    s = exporter.scrape()
    return size, value(s, "shmwatch_mount_peak_used_bytes", mount=shm), value(s, "shmwatch_mount_used_bytes", mount=shm)


def main():
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs")
    with mounted_tmpfs("64m") as shm, Exporter(f"--shm.mount={shm}", "--no-collector.gpu") as exporter:
        lat = detection(shm, exporter)
    print(f"detection latency, 100 x 4 MiB nccl-XXXXXX: p50 {percentile(lat, 50) * 1000:.0f} ms, "
          f"p99 {percentile(lat, 99) * 1000:.0f} ms, max {max(lat) * 1000:.0f} ms (target p99 <= 1 s)")
    with mounted_tmpfs("32m") as shm, Exporter(f"--shm.mount={shm}", "--no-collector.gpu") as exporter:
        size, peak, used = spike(shm, exporter)
    print(f"2 s spike to 90 % of a 32 MiB tmpfs, no scrape during it: peak {peak / size:.1%} of size, "
          f"used now {used / size:.1%} (target peak >= 90 %)")


if __name__ == "__main__":
    main()
