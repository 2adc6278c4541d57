#!/usr/bin/env python3
"""What shmwatch costs the Prometheus that scrapes it (run as root: it mounts tmpfs and makes
memory cgroups). One run, each figure beside its goal, for this checkout and for any other
given with --code (e.g. a worktree of the code before a change, then this one), in one run:

- node mode, 200 pod emptyDirs at real kubelet paths, 5 segments of 64 KiB each, two holder
  processes a pod in its memory cgroup (bench/node_scale.py's Pods): series a pod (those
  that name the pod's UID), bytes a series (the text format's bytes over its series), MB a
  scrape (text 0.0.4, uncompressed; gzip beside it); series of pods not the benchmark's (another
  run on the machine) are left out of every figure but the render's time
- new series under churn: 10 creates/s spread over the pods, each segment deleted 10 s
  later, scraped every 15 s as Prometheus does: series no earlier scrape had, a second, after
  the first minute (the series a class's counters add once), and the first minute's apart
- a leaked segment by name: a file nobody holds (just written, and last written an hour ago),
  until the inventory calls it orphan, then whether the same scrape names it (node mode with --segments.full-scan-interval=0, so each
  inventory run may call a segment orphan; the sidecar with its defaults)
- a fresh render at 200 pods beside node_exporter (Debian's prometheus-node-exporter:
  filesystem and meminfo only, its mount-point exclude emptied so it reports the same tmpfs),
  scrapes 1.2 s apart so each meets a new render, as bench/node_scale.py asks
- the sidecar at 1,000 segments (4 KiB each, mixed classes: bench/inventory.py's): series,
  bytes, and new series under the same churn in its one mount

    sudo python3 bench/cardinality.py [--code /work/wt/old --code .] [--churn-seconds 300]
        [--only node|sidecar|render]
"""

from __future__ import annotations

import argparse
import gzip
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Set, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from tests.conftest import Exporter, mounted_tmpfs  # noqa: E402

import inventory  # noqa: E402
import node_scale  # noqa: E402

PODS = 200
HOLDERS_A_POD = 2
SIDECAR_SEGMENTS = 1000
SCRAPE_INTERVAL = 15.0
CREATES_A_SECOND = 10.0
WARM_UP = 60.0  # a class's counters and the first inventories' series appear once
TEXT = {"Accept": "text/plain;version=0.0.4"}
UID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


class CodeExporter(Exporter):
    """tests.conftest.Exporter, but `python3 -m exporter` run from another checkout."""

    def __init__(self, code: str, *args: str) -> None:
        super().__init__(*args)
        self.code = code

    def __enter__(self) -> "CodeExporter":
        self.stderr = open(self.stderr_path, "wb")
        self.proc = subprocess.Popen(
            self.args, cwd=self.code, env=self.env, stdout=subprocess.DEVNULL, stderr=self.stderr
        )
        self.wait_ready(timeout=60.0)
        return self


@dataclass
class Figure:
    what: str
    goal: str
    values: Dict[str, str] = field(default_factory=dict)  # code label -> value


@dataclass
class Table:
    figures: Dict[str, Figure] = field(default_factory=dict)

    def put(self, key: str, goal: str, code: str, value: str) -> None:
        self.figures.setdefault(key, Figure(what=key, goal=goal)).values[code] = value

    def print(self, codes: Sequence[str]) -> None:
        header = ["figure", *codes, "goal"]
        rows = [[f.what, *(f.values.get(c, "-") for c in codes), f.goal] for f in self.figures.values()]
        widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
        print(" | ".join(h.ljust(w) for h, w in zip(header, widths)))
        print("-|-".join("-" * w for w in widths))
        for row in rows:
            print(" | ".join(c.ljust(w) for c, w in zip(row, widths)))


def ours(text: bytes, uids: Sequence[str]) -> bytes:
    """The lines of `text` that name none of the pods but `uids` (node mode: another run's
    pods on the machine, e.g. bench/node_scale.py's, are left out of every figure)."""
    if not uids:
        return text
    mine = set(uids)
    kept = [line for line in text.splitlines(keepends=True)
            if set(UID.findall(line.decode(errors="replace"))) <= mine]
    return b"".join(kept)


def series_of(text: str) -> List[str]:
    """Each sample line's name and labels (the value cut off)."""
    return [line.rsplit(" ", 1)[0] for line in text.splitlines() if line and not line.startswith("#")]


def scrape(url: str, headers: Dict[str, str]) -> bytes:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=20) as response:
        body: bytes = response.read()
        if response.headers.get("Content-Encoding") == "gzip":
            body = gzip.decompress(body)
        return body


def label(code: str) -> str:
    head = subprocess.run(["git", "-C", code, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", code, "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True).stdout.strip()
    return (head.stdout.strip() or os.path.basename(code)) + ("+" if dirty else "")


# ---- what a scrape costs -----------------------------------------------------------------


def per_pod(series: List[str], uids: Sequence[str]) -> Tuple[float, int, int]:
    """(mean and most series that name a pod's UID, series that name none)."""
    counts = {uid: 0 for uid in uids}
    unnamed = 0
    for line in series:
        found = set(UID.findall(line)) & counts.keys()
        for uid in found:
            counts[uid] += 1
        unnamed += not found
    values = list(counts.values())
    return sum(values) / len(values), max(values), unnamed


def scrape_costs(table: Table, code: str, exporter: Exporter, uids: Sequence[str], where: str) -> None:
    text = ours(scrape(exporter.url, TEXT), uids)
    series = series_of(text.decode())
    packed = len(gzip.compress(text, 1))
    if uids:
        mean, most, unnamed = per_pod(series, uids)
        table.put(f"{where}: series a pod", "<= 20", code,
                  f"{mean:.1f} (most {most}; {unnamed} name no pod)")
    else:
        table.put(f"{where}: series", "-", code, f"{len(series):,}")
    goal = "<= 150" if uids else "-"
    table.put(f"{where}: bytes a series", goal, code, f"{len(text) / len(series):.0f} ({len(series):,} series)")
    goal = "<= 0.8" if uids else "-"
    table.put(f"{where}: MB a scrape (text 0.0.4)", goal, code,
              f"{len(text) / 1e6:.3f} (gzip {packed / 1e6:.3f})")


# ---- new series under churn ----------------------------------------------------------------


def new_series_under_churn(exporter: Exporter, mounts: Sequence[str], seconds: float,
                           uids: Sequence[str]) -> Tuple[float, int]:
    """(new series a second after the first minute, series new in the first minute) while
    segments are created at CREATES_A_SECOND over `mounts`, each deleted 10 s later."""
    seen: Set[str] = set(series_of(ours(scrape(exporter.url, TEXT), uids).decode()))
    stop = threading.Event()
    creator = threading.Thread(target=churn, args=(mounts, stop), daemon=True)
    started = time.monotonic()
    creator.start()
    early = late = 0
    try:
        while time.monotonic() - started < seconds:
            time.sleep(SCRAPE_INTERVAL)
            now = set(series_of(ours(scrape(exporter.url, TEXT), uids).decode()))
            new = len(now - seen)
            seen |= now
            if time.monotonic() - started <= WARM_UP + SCRAPE_INTERVAL / 2:
                early += new
            else:
                late += new
    finally:
        stop.set()
        creator.join()
    return late / (time.monotonic() - started - WARM_UP), early


def churn(mounts: Sequence[str], stop: threading.Event) -> None:
    live: List[Tuple[float, str]] = []
    started, i = time.monotonic(), 0
    while not stop.is_set():
        path = os.path.join(mounts[i % len(mounts)], f"psm_churn{i:07d}")
        node_scale.segment_file(path)
        live.append((time.monotonic(), path))
        while live and live[0][0] < time.monotonic() - 10:
            os.unlink(live.pop(0)[1])
        i += 1
        stop.wait(max(0.0, started + i / CREATES_A_SECOND - time.monotonic()))
    for _, path in live:
        os.unlink(path)


def churn_row(table: Table, code: str, exporter: Exporter, mounts: Sequence[str], where: str,
              seconds: float, uids: Sequence[str] = ()) -> None:
    rate, early = new_series_under_churn(exporter, mounts, seconds, uids)
    table.put(f"{where}: new series a second under churn (after the first minute)", "<= 0.1", code,
              f"{rate:.2f} ({rate * 3600:,.0f} an hour; {early:,} in the first minute)")


# ---- a leak named ----------------------------------------------------------------------------


def orphans(text: str, labels: str) -> float:
    """The orphan segments the series carrying `labels` count."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("shmwatch_segments{") and 'state="orphan"' in line and labels in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


def settled_orphans(exporter: Exporter, labels: str, timeout: float = 60.0) -> float:
    """The orphans counted once two scrapes a second apart agree (the churn's last deletes
    inventoried)."""
    last, deadline = None, time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = orphans(scrape(exporter.url, TEXT).decode(), labels)
        if now == last:
            return now
        last = now
        time.sleep(1.0)
    raise TimeoutError("the orphan count did not settle")


def leak_named(exporter: Exporter, mount: str, labels: str, written_ago: float = 0.0,
               timeout: float = 120.0) -> str:
    """A file nobody holds in `mount`, last written `written_ago` seconds ago: scrapes until
    the inventory counts it orphan, and says whether that scrape names it (state orphan) or
    how many scrapes (and seconds) later one did."""
    before = settled_orphans(exporter, labels)
    name = f"psm_leak{time.monotonic_ns()}"
    path = os.path.join(mount, name)
    node_scale.segment_file(path, 1 << 20)
    then = time.time() - written_ago
    os.utime(path, (then, then))
    deadline, counted_at, scrapes, counted_time = time.monotonic() + timeout, None, 0, 0.0
    try:
        while time.monotonic() < deadline:
            text = scrape(exporter.url, TEXT).decode()
            named = any(f'name="{name}"' in line and 'state="orphan"' in line for line in text.splitlines())
            if counted_at is None and orphans(text, labels) > before:
                counted_at, counted_time = scrapes, time.monotonic()
            if named:
                if counted_at == scrapes:
                    return "same scrape"
                later = time.monotonic() - counted_time
                return f"{scrapes - (counted_at or 0)} scrapes ({later:.1f} s) later"
            scrapes += counted_at is not None
            time.sleep(0.25)
        return "never counted orphan" if counted_at is None else "counted orphan, never named"
    finally:
        os.unlink(os.path.join(mount, name))


# ---- the runs --------------------------------------------------------------------------------


def node_rows(table: Table, codes: Sequence[Tuple[str, str]], churn_seconds: float) -> None:
    with node_scale.Pods(PODS) as pods:
        pods.start_processes(PODS * HOLDERS_A_POD)
        for code, name in codes:
            args = ("--mode=node", "--no-collector.gpu", "--log.level=error")
            with CodeExporter(code, *args) as exporter:
                time.sleep(70)  # past the first full scan, and the segments over a minute old
                scrape_costs(table, name, exporter, pods.uids, "node mode, 200 pods")
                churn_row(table, name, exporter, pods.mounts, "node mode, 200 pods", churn_seconds, pods.uids)
            with CodeExporter(code, *args, "--segments.full-scan-interval=0", "--inventory-interval=2s") as exporter:
                time.sleep(5)
                uid = pods.uids[0]
                for ago, written in ((0.0, "just written"), (3600.0, "written an hour ago")):
                    table.put(f"node mode: a leak {written} named, by the scrape that counts it orphan",
                              "same scrape", name, leak_named(exporter, pods.mounts[0], uid, ago))


def render_rows(table: Table, codes: Sequence[Tuple[str, str]]) -> None:
    node_exporter = node_scale.node_exporter_cls()
    with node_scale.Pods(PODS) as pods, node_exporter() as theirs:
        pods.start_processes(PODS * HOLDERS_A_POD)
        for code, name in codes:
            with CodeExporter(code, "--mode=node", "--no-collector.gpu", "--log.level=error") as ours:
                time.sleep(35)
                for asked, headers in node_scale.FORMATS:
                    mine, _ = node_scale.scrape_times(ours.url, node_scale.SPACED, headers, gap=1.2)
                    peer, _ = node_scale.scrape_times(theirs.url, node_scale.SPACED, headers, gap=1.2)
                    ratio = node_scale.percentile(mine, 50) / node_scale.percentile(peer, 50)
                    table.put(f"node mode, 200 pods: fresh render, {asked} asked, gzip (p50 / node_exporter's)",
                              "<= 0.7", name,
                              f"x{ratio:.2f} ({node_scale.percentile(mine, 50) * 1000:.1f} / "
                              f"{node_scale.percentile(peer, 50) * 1000:.1f} ms)")


def sidecar_rows(table: Table, codes: Sequence[Tuple[str, str]], churn_seconds: float) -> None:
    for code, name in codes:
        with mounted_tmpfs("64m") as shm:
            inventory.build(shm, SIDECAR_SEGMENTS)
            with CodeExporter(code, f"--shm.mount={shm}", "--no-collector.gpu", "--log.level=error") as exporter:
                time.sleep(20)
                where = "sidecar, 1,000 segments"
                scrape_costs(table, name, exporter, (), where)
                churn_row(table, name, exporter, [shm], where, churn_seconds)
                for ago, written in ((0.0, "just written"), (3600.0, "written an hour ago")):
                    table.put(f"sidecar: a leak {written} named, by the scrape that counts it orphan",
                              "same scrape", name, leak_named(exporter, shm, f'mount="{shm}"', ago))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--code", action="append", default=[],
                        help="a checkout to measure, in the order given (repeatable; default: this one), "
                        "e.g. a worktree of main and then this one")
    parser.add_argument("--churn-seconds", type=float, default=300.0)
    parser.add_argument("--only", choices=("node", "sidecar", "render"))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs and creates cgroups")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    codes = [(os.path.abspath(c), label(c)) for c in args.code or [os.path.dirname(HERE)]]
    table = Table()
    steps: List[Tuple[str, Callable[[], None]]] = [
        ("node", lambda: node_rows(table, codes, args.churn_seconds)),
        ("render", lambda: render_rows(table, codes)),
        ("sidecar", lambda: sidecar_rows(table, codes, args.churn_seconds)),
    ]
    try:
        for what, step in steps:
            if args.only in (None, what):
                step()
    finally:
        table.print([name for _, name in codes])


if __name__ == "__main__":
    main()
