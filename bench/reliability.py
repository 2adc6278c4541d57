#!/usr/bin/env python3
"""The long versions of the reliability tests (run as root): 50 concurrent scrapers for
60 s, and 10 minutes of segment churn with RSS and open fds sampled.

    sudo python3 bench/reliability.py [--load-seconds 60] [--soak-seconds 600]
"""
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import Exporter, fallocate, mounted_tmpfs  # noqa: E402
from tests.system.test_reliability import load, rss_and_fds  # noqa: E402

MiB = 1 << 20


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--load-seconds", type=float, default=60)
    parser.add_argument("--soak-seconds", type=float, default=600)
    args = parser.parse_args()
    with mounted_tmpfs("64m") as shm:
        for i in range(1000):
            fallocate(os.path.join(shm, f"psm_{i}"), 4096)
        with Exporter(f"--shm.mount={shm}", "--no-collector.gpu") as exporter:
            latencies, errors = load(exporter.url, clients=50, seconds=args.load_seconds)
        latencies.sort()
        print(f"load: 50 scrapers x {args.load_seconds:.0f} s over 1,000 segments: {len(latencies)} scrapes, "
              f"{len(errors)} errors, p50 {latencies[len(latencies) // 2] * 1000:.1f} ms, "
              f"p99 {latencies[int(len(latencies) * 0.99) - 1] * 1000:.1f} ms", flush=True)
    with mounted_tmpfs("64m") as shm, Exporter(f"--shm.mount={shm}", "--no-collector.gpu") as exporter:
        time.sleep(2)
        start_rss, start_fds = rss_and_fds(exporter.proc.pid)
        samples = []
        started, i, next_sample = time.monotonic(), 0, time.monotonic()
        while time.monotonic() - started < args.soak_seconds:
            fallocate(os.path.join(shm, f"nccl-{i:08x}"), 65536)
            if i >= 50:
                os.unlink(os.path.join(shm, f"nccl-{i - 50:08x}"))
            i += 1
            if i % 50 == 0:
                time.sleep(0.01)  # ~ a few thousand segment lifetimes a second, not a tight loop
            if time.monotonic() >= next_sample:
                samples.append((time.monotonic() - started, *rss_and_fds(exporter.proc.pid)))
                exporter.scrape_text()
                next_sample += 60
        end_rss, end_fds = rss_and_fds(exporter.proc.pid)
    print(f"soak: {args.soak_seconds:.0f} s, {i:,} segments created and deleted; RSS {start_rss / MiB:.1f} -> "
          f"{end_rss / MiB:.1f} MiB, open fds {start_fds} -> {end_fds}")
    for t, rss, fds in samples:
        print(f"  t={t:5.0f}s  RSS {rss / MiB:6.1f} MiB  fds {fds}")


if __name__ == "__main__":
    main()
