#!/usr/bin/env python3
"""This tree's HTTP front against another commit's, in one run (run as root): two exporters
on the same tmpfs of --segments files, scraped in turn (the order swapped each round, so a
neighbour's load falls on both), with Prometheus's own headers (OpenMetrics asked, gzip):

- over one kept-alive connection each (as Prometheus scrapes), and
- a new connection a scrape (as bench/compare.py and curl do);

latency p50/p99/mean of each and the ratio this tree / the other (goal: p50 <= 1.0), and the
CPU each exporter used over the whole run, background sources included.

    sudo python3 bench/front_compare.py [--ref main] [--scrapes 2000] [--segments 1000]
"""

import argparse
import http.client
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tests.conftest import free_port, mounted_tmpfs  # noqa: E402

import inventory  # noqa: E402
from node_scale import PROMETHEUS_HEADERS  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Served:
    """One exporter, started from a tree, and what its scrapes took."""

    name: str
    tree: str
    port: int = field(default_factory=free_port)
    times: Dict[str, List[float]] = field(default_factory=dict)

    def start(self, shm: str) -> None:
        args = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{self.port}",
                f"--shm.mount={shm}", "--no-collector.gpu"]
        self.proc = subprocess.Popen(args, cwd=self.tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as response:
                    if b"shmwatch_collector_duration_seconds" in response.read():
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: not ready")
            time.sleep(0.1)
        self.connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)

    def kept_alive(self) -> None:
        self.connection.request("GET", "/metrics", headers=PROMETHEUS_HEADERS)
        response = self.connection.getresponse()
        assert response.status == 200 and response.read()

    def new_connection(self) -> None:
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/metrics", headers=PROMETHEUS_HEADERS)
        with urllib.request.urlopen(request, timeout=10) as response:
            assert response.status == 200 and response.read()

    def timed(self, how: str, scrape: Callable[[], None]) -> None:
        started = time.perf_counter()
        scrape()
        self.times.setdefault(how, []).append(time.perf_counter() - started)

    def cpu_seconds(self) -> float:
        with open(f"/proc/{self.proc.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


def percentile(values: List[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def checkout(ref: str, into: str) -> str:
    """`ref`'s tree (git archive), as the other exporter runs it."""
    archive = os.path.join(into, "tree.tar")
    with open(archive, "wb") as f:
        subprocess.run(["git", "-C", REPO, "archive", ref], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(os.path.join(into, "tree"), filter="data")
    return os.path.join(into, "tree")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", default="main", help="the commit whose front this tree's is measured against")
    parser.add_argument("--scrapes", type=int, default=2000)
    parser.add_argument("--segments", type=int, default=1000)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs")
    with tempfile.TemporaryDirectory() as work, mounted_tmpfs("64m") as shm:
        inventory.build(shm, args.segments)
        ours, theirs = Served("this tree", REPO), Served(args.ref, checkout(args.ref, work))
        for served in (ours, theirs):
            served.start(shm)
        time.sleep(2)
        cpu = {s.name: s.cpu_seconds() for s in (ours, theirs)}
        started = time.monotonic()
        for how in ("kept_alive", "new_connection"):
            for i in range(args.scrapes):
                pair = (ours, theirs) if i % 2 else (theirs, ours)
                for served in pair:
                    served.timed(how, getattr(served, how))
            for served in (ours, theirs):  # each way alone: no connection kept beside
                served.connection.close()
        seconds = time.monotonic() - started
        cpu = {s.name: s.cpu_seconds() - cpu[s.name] for s in (ours, theirs)}
        for served in (ours, theirs):
            served.stop()
    load = os.getloadavg()[0]
    print(f"{args.scrapes} scrapes each way, {args.segments:,} segments, Prometheus's headers "
          f"(OpenMetrics, gzip); load average {load:.1f}")
    print("| scrape | this tree | " + args.ref + " | ratio |")
    print("|---|---|---|---|")
    for how in ("kept_alive", "new_connection"):
        a, b = ours.times[how], theirs.times[how]
        cells = [f"p50 {percentile(t, 50) * 1000:.3f} ms, p99 {percentile(t, 99) * 1000:.3f} ms, "
                 f"mean {statistics.mean(t) * 1000:.3f} ms" for t in (a, b)]
        ratio = f"p50 x{percentile(a, 50) / percentile(b, 50):.3f}, mean x{statistics.mean(a) / statistics.mean(b):.3f}"
        print(f"| {how.replace('_', ' ')} | {cells[0]} | {cells[1]} | {ratio} |")
    print(f"| CPU over the {seconds:.0f} s run | {cpu[ours.name]:.2f} s | {cpu[theirs.name]:.2f} s | "
          f"x{cpu[ours.name] / cpu[theirs.name]:.3f} |")


if __name__ == "__main__":
    main()
