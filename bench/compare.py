#!/usr/bin/env python3
"""One table, one run: shmwatch's costs, side by side with node_exporter (run as root).

- scrape latency p50/p99 of shmwatch and of node_exporter (Debian prometheus-node-exporter,
  only its filesystem and meminfo collectors, mount-point exclude emptied so it reports the
  same tmpfs) at 0, 1,000 and 10,000 segments; ratio shmwatch / node_exporter (goal <= 1.0)
- inventory cycle at 10,000 segments x 300 processes (goal <= 200 ms)
- idle CPU (% of one core) and RSS over 60 s at default intervals (goals <= 0.5 %, <= 40 MiB)
- detection latency p99 of a new nccl segment (goal <= 1 s: the first scrape after the debounce)
- node mode (bench/node_scale.py): scrape p50/p99 beside node_exporter at 50, 200 and 500
  pod mounts; idle CPU, CPU under churn (10 creates/s over 200 pods, 2,000 processes) and
  detection p99 under that churn

    sudo python3 bench/compare.py [--idle-seconds 60] [--scrapes 300] [--only sidecar|node]
"""
import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.conftest import Exporter, free_port, mounted_tmpfs  # noqa: E402

import detection  # noqa: E402
import inventory  # noqa: E402
import node_scale  # noqa: E402

MiB = 1 << 20


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


class NodeExporter:
    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/metrics"
        binary = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")
        if binary is None:
            sys.exit("install Debian's prometheus-node-exporter")
        self.args = [binary, f"--web.listen-address=127.0.0.1:{self.port}", "--collector.disable-defaults",
                     "--collector.filesystem", "--collector.meminfo",
                     "--collector.filesystem.mount-points-exclude=^$", "--log.level=error"]

    def __enter__(self):
        self.proc = subprocess.Popen(self.args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                urllib.request.urlopen(self.url, timeout=1).read()
                return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("node_exporter did not start")

    def __exit__(self, *exc):
        self.proc.terminate()
        self.proc.wait()


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--idle-seconds", type=float, default=60)
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--only", choices=("sidecar", "node"))
    parser.add_argument("--churn-seconds", type=float, default=120,
                        help="node mode: how long the churn and detection rows create (whole full-scan intervals)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs")
    rows = [] if args.only == "node" else sidecar_rows(args)
    if args.only != "sidecar":
        # Node idle over a whole full-scan interval (2m) at least.
        rows += node_scale.scrape_rows(args.scrapes) + node_scale.cpu_rows(args.churn_seconds,
                                                                           max(120.0, args.idle_seconds))
    print_table(rows)


def sidecar_rows(args):
    rows = []
    for count in (0, 1000, 10000):
        with mounted_tmpfs("256m") as shm:
            inventory.build(shm, count)
            with Exporter(f"--shm.mount={shm}") as ours, NodeExporter() as theirs:
                assert f'mountpoint="{shm}"' in urllib.request.urlopen(theirs.url).read().decode()
                time.sleep(1)
                # Prometheus's own Accept and Accept-Encoding first (what it really fetches),
                # then a text-format scraper's; the cell says which format was served.
                for asked, headers in node_scale.FORMATS:
                    a, served_a = node_scale.scrape_times(ours.url, args.scrapes, headers)
                    b, served_b = node_scale.scrape_times(theirs.url, args.scrapes, headers)
                    rows.append((f"scrape latency, {count:,} segments, {asked} asked, gzip",
                                 f"{node_scale.latency(a)} ({served_a})", f"{node_scale.latency(b)} ({served_b})",
                                 node_scale.ratio(a, b), "p50 <= 0.8"))

    with tempfile.TemporaryDirectory() as work, mounted_tmpfs("256m") as shm:
        names = inventory.build(shm, 10000)
        holders = inventory.start_holders(shm, names, 300, 10, work)
        try:
            from exporter.collectors.segments import SegmentsCollector
            from exporter.collectors.source import RunInput
            from exporter.host.paths import Paths
            collector, run = SegmentsCollector(Paths()), RunInput(mounts=(shm,))
            collector.collect(run)
            full, _ = inventory.timed(lambda: collector.collect(run), 10)
        finally:
            for proc in holders:
                proc.stdin.close()
            for proc in holders:
                proc.wait()
    rows.append(("inventory cycle, 10,000 segments x 300 processes",
                 f"median {statistics.median(full) * 1000:.0f} ms, max {max(full) * 1000:.0f} ms", "-", "-",
                 "<= 200 ms"))

    with mounted_tmpfs("64m") as shm:
        inventory.build(shm, 1000)
        with Exporter(f"--shm.mount={shm}") as ours, NodeExporter() as theirs:
            # Both scraped as Prometheus would (every 15 s): shmwatch renders for the scrapes.
            scraping = [node_scale.prometheus_scraping(ours), node_scale.prometheus_scraping(theirs)]
            time.sleep(35)  # past the first inventory intervals, and the scrape interval learnt
            c0, t0, n0 = cpu_seconds(ours.proc.pid), time.monotonic(), cpu_seconds(theirs.proc.pid)
            time.sleep(args.idle_seconds)
            c1, t1, n1 = cpu_seconds(ours.proc.pid), time.monotonic(), cpu_seconds(theirs.proc.pid)
            for stop in scraping:
                stop.set()
            ours_cpu, theirs_cpu = 100 * (c1 - c0) / (t1 - t0), 100 * (n1 - n0) / (t1 - t0)
            rows.append((f"idle CPU over {args.idle_seconds:.0f} s, default intervals, 1,000 segments, "
                         "scraped every 15 s", f"{ours_cpu:.2f} % of a core",
                         f"{theirs_cpu:.2f} % (scrape-driven)", "-", "<= 0.5 %"))
            rows.append(("RSS", f"{rss(ours.proc.pid) / MiB:.1f} MiB", f"{rss(theirs.proc.pid) / MiB:.1f} MiB",
                         f"x{rss(ours.proc.pid) / rss(theirs.proc.pid):.2f}", "<= 40 MiB"))

    with mounted_tmpfs("64m") as shm, Exporter(f"--shm.mount={shm}", "--no-collector.gpu") as ours:
        lat = detection.detection(shm, ours)
    rows.append(("detection latency, new 4 MiB nccl segment -> /metrics",
                 f"p50 {percentile(lat, 50) * 1000:.0f} ms, p99 {percentile(lat, 99) * 1000:.0f} ms",
                 "never (scrape-time only; no per-segment view)", "-", "p99 <= 1 s"))
    return rows


def print_table(rows):
    widths = [max(len(r[i]) for r in rows + [("what", "shmwatch", "node_exporter", "ratio", "goal")])
              for i in range(5)]
    header = ("what", "shmwatch", "node_exporter", "ratio", "goal")
    print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


if __name__ == "__main__":
    main()
