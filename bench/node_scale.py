#!/usr/bin/env python3
"""Node mode at cluster scale, beside node_exporter (run as root; compare.py prints the rows).

- scrape p50/p99 of `shmwatch --mode=node` and of node_exporter (filesystem + meminfo,
  exclude emptied: it reports the same tmpfs) at 50, 200 and 500 pod emptyDirs, 5 segments each,
  asked as Prometheus asks (OpenMetrics first, gzip) and as a text-format scraper; at 200 also
  with scrapes 1.2 s apart, each meeting a new render as Prometheus's do
- idle CPU at 200 pods with 2,000 real processes (bench/map_hold.c) mapping their segments,
  each in its pod's memory cgroup (cgroup v1 here), so the process table knows its pod
- churn: 10 creates/s spread over the 200 pods (each deleted 10 s later): CPU, and the p99
  from a create to its segment counted in /metrics (its pod's shmwatch_segments: a segment
  that lives 10 s is never named)

    sudo python3 bench/node_scale.py [--seconds 30] [--idle-seconds 120]
    sudo python3 bench/node_scale.py --only cpu --tree aad3219 --tree .   # the old core beside

With --tree, the CPU rows run every tree's exporter at once on the same pods (the same load for
each, in one run) and add CPU per thread (its name, from bench/thread_names/).
"""
import argparse
import gzip
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from contextlib import ExitStack

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import REPO, Exporter  # noqa: E402

V1 = "/sys/fs/cgroup/memory"
HERE = os.path.dirname(os.path.abspath(__file__))

# What Prometheus sends on every scrape (Debian bookworm's 2.42, captured with a tiny HTTP
# server): it asks for OpenMetrics first, and for gzip. The figures are for what it fetches.
PROMETHEUS_HEADERS = {
    "Accept": "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,"
              "text/plain;version=0.0.4;q=0.5,*/*;q=0.1",
    "Accept-Encoding": "gzip",
}
# A scraper that takes the text format (0.0.4: curl, older Prometheus, most other agents), gzip too.
TEXT_HEADERS = {"Accept": "text/plain;version=0.0.4", "Accept-Encoding": "gzip"}
FORMATS = (("OpenMetrics", PROMETHEUS_HEADERS), ("text 0.0.4", TEXT_HEADERS))
SPACED = 20  # scrapes, each after a poll interval and more: each meets a new render


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def segment_file(path, size=65536):
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o600)
    os.posix_fallocate(fd, 0, size)
    os.close(fd)


class Pods:
    """`count` pod emptyDirs (real tmpfs at kubelet paths), 5 segments each, a memory cgroup each."""

    def __init__(self, count):
        self.count = count
        self.work = tempfile.mkdtemp(prefix="shmwatch-node-scale-")
        self.uids = [str(uuid.uuid4()) for _ in range(count)]
        self.mounts, self.cgroups, self.holders = [], [], []

    def __enter__(self):
        try:
            self._make()
        except BaseException:  # __exit__ is not called for a failed __enter__
            self.__exit__()
            raise
        return self

    def _make(self):
        burstable = os.path.join(V1, "kubepods", "burstable")
        stale = [d for d in os.listdir(burstable) if d.startswith("pod")] if os.path.isdir(burstable) else []
        if stale:  # node mode reads every pod cgroup on the host: the figures would include them
            print(f"warning: {len(stale)} pod cgroups already in {burstable} (an interrupted run's?)",
                  file=sys.stderr)
        for uid in self.uids:
            path = f"{self.work}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"
            os.makedirs(path)
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", path], check=True)
            self.mounts.append(path)
            for i in range(5):
                segment_file(os.path.join(path, f"psm_{i:02d}"))
            if os.path.exists(os.path.join(V1, "memory.usage_in_bytes")):
                cg = os.path.join(V1, "kubepods", "burstable", f"pod{uid}")
                os.makedirs(cg, exist_ok=True)
                self.cgroups.append(cg)

    def start_processes(self, count):
        binary = os.path.join(self.work, "map_hold")
        subprocess.run(["gcc", "-O1", "-o", binary, os.path.join(HERE, "map_hold.c")], check=True)
        for p in range(count):
            pod = p % self.count
            mount = self.mounts[pod]
            proc = subprocess.Popen([binary, os.path.join(mount, f"psm_{p % 5:02d}"),
                                     os.path.join(mount, f"psm_{(p + 1) % 5:02d}")],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            self.holders.append(proc)
            if self.cgroups:
                with open(os.path.join(self.cgroups[pod], "cgroup.procs"), "w") as f:
                    f.write(str(proc.pid))
        for proc in self.holders:
            proc.stdout.readline()

    def __exit__(self, *exc):
        for proc in self.holders:
            proc.stdin.close()
        for proc in self.holders:
            proc.wait()
        for path in self.mounts:
            subprocess.run(["umount", "-l", path], check=False)
        for cg in self.cgroups:
            for _ in range(50):
                try:
                    os.rmdir(cg)
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.05)
        for parent in ("kubepods/burstable", "kubepods"):
            try:
                os.rmdir(os.path.join(V1, parent))
            except OSError:
                pass
        shutil.rmtree(self.work, ignore_errors=True)


def node_exporter_cls():
    import compare  # the same node_exporter set-up as the sidecar rows (imported late: it imports us)
    return compare.NodeExporter


def ours(tree=REPO, env=None):
    return Exporter("--mode=node", "--no-collector.gpu", "--log.level=error", tree=tree, env=env)


def served_format(content_type):
    return "OpenMetrics" if content_type.startswith("application/openmetrics-text") else "text"


def scrape_times(url, n, headers=PROMETHEUS_HEADERS, gap=0.0):
    """n scrapes' wall times, and the format (from its Content-Type) the server answered in.
    With `gap`, that long between scrapes."""
    times, served = [], set()
    request = urllib.request.Request(url, headers=headers)
    for _ in range(n):
        time.sleep(gap)
        started = time.perf_counter()
        with urllib.request.urlopen(request, timeout=10) as response:
            response.read()
            served.add(served_format(response.headers.get("Content-Type", "")))
        times.append(time.perf_counter() - started)
    return times, "/".join(sorted(served))


def latency(times):
    return f"p50 {percentile(times, 50) * 1000:.2f} ms, p99 {percentile(times, 99) * 1000:.2f} ms"


def ratio(a, b):
    return f"p50 x{percentile(a, 50) / percentile(b, 50):.2f}, p99 x{percentile(a, 99) / percentile(b, 99):.2f}"


def scrape_rows(scrapes):
    rows = []
    NodeExporter = node_exporter_cls()
    for count in (50, 200, 500):
        with Pods(count) as pods, ours() as a, NodeExporter() as b:
            text = a.scrape_text()
            assert text.count("shmwatch_mount_size_bytes{") >= count, "not every pod mount discovered"
            assert pods.mounts[0] in urllib.request.urlopen(b.url).read().decode()
            time.sleep(2)
            samples = sum(1 for line in text.splitlines() if line and not line.startswith("#"))
            for asked, headers in FORMATS:
                (ta, fa), (tb, fb) = scrape_times(a.url, scrapes, headers), scrape_times(b.url, scrapes, headers)
                rows.append((f"node mode scrape, {count} pod mounts ({samples:,} samples), "
                             f"{asked} asked, gzip", f"{latency(ta)} ({fa})", f"{latency(tb)} ({fb})",
                             ratio(ta, tb), "p50 <= 1.0"))
            if count != 200:
                continue
            # Back-to-back scrapes mostly meet a render some scrape already served; Prometheus's,
            # 15-60 s apart, each meet a new one (the model changes every poll): so do these.
            for asked, headers in FORMATS:
                (ta, fa), (tb, fb) = (scrape_times(a.url, SPACED, headers, gap=1.2),
                                      scrape_times(b.url, SPACED, headers, gap=1.2))
                rows.append((f"node mode scrape, {count} pod mounts, {asked} asked, gzip, "
                             f"{SPACED} scrapes 1.2 s apart", f"{latency(ta)} ({fa})", f"{latency(tb)} ({fb})",
                             ratio(ta, tb), "p50 <= 1.0"))
    return rows


SEGMENTS = re.compile(r'^shmwatch_segments\{[^}]*pod_uid="([^"]+)"[^}]*\} (\S+)$', re.M)


def segments_by_pod(text):
    """pod UID -> the segments /metrics counts in its mounts."""
    counts = {}
    for uid, value in SEGMENTS.findall(text):
        counts[uid] = counts.get(uid, 0) + float(value)
    return counts


def churn(pods, seconds, rate=10.0, watch=None):
    """Creates `rate` segments/s round-robin over the pods, each deleted 10 s later (a pod's
    before its next: 200 pods take 20 s a round). With `watch` (an exporter and a list), also
    records each create's latency to the exporter's /metrics in the list (a gzip scrape every
    25 ms): until its pod's segments are counted one more than its 5."""
    live, latencies, stop = [], [], threading.Event()
    pending = {}  # name -> (created at, pod UID)
    lock = threading.Lock()

    def scraper():
        request = urllib.request.Request(watch[0].url, headers=PROMETHEUS_HEADERS)
        while not stop.is_set():
            with urllib.request.urlopen(request, timeout=10) as response:
                counts = segments_by_pod(gzip.decompress(response.read()).decode())
            now = time.monotonic()
            with lock:
                for name in [n for n, (_, uid) in pending.items() if counts.get(uid, 0) > 5]:
                    latencies.append(now - pending.pop(name)[0])
            time.sleep(0.025)

    thread = threading.Thread(target=scraper, daemon=True) if watch is not None else None
    if thread:
        thread.start()
    started, i = time.monotonic(), 0
    while time.monotonic() - started < seconds:
        mount = pods.mounts[i % len(pods.mounts)]
        name = f"psm_churn{i:06d}"
        path = os.path.join(mount, name)
        with lock:
            pending[name] = (time.monotonic(), pods.uids[i % len(pods.mounts)])
        segment_file(path)
        live.append((time.monotonic(), path))
        while live and live[0][0] < time.monotonic() - 10:
            os.unlink(live.pop(0)[1])
        i += 1
        time.sleep(max(0.0, started + i / rate - time.monotonic()))
    time.sleep(1.0)
    stop.set()
    if thread:
        thread.join()
        watch[1].extend(latencies)
        watch[1].append(float("inf")) if pending else None  # a create never seen counts as missed
    for _, path in live:
        os.unlink(path)


def prometheus_scraping(exporter, interval=15.0):
    """A Prometheus-like scraper in the background (its user agent, its interval), so idle
    CPU is measured as deployed: each scrape renders the model once."""
    stop = threading.Event()
    request = urllib.request.Request(exporter.url, headers={"Accept-Encoding": "gzip",
                                                            "User-Agent": "Prometheus/2.45.3"})

    def scrape():
        while True:
            with urllib.request.urlopen(request, timeout=10) as response:
                response.read()
            if stop.wait(interval):
                return

    thread = threading.Thread(target=scrape, daemon=True)
    thread.start()
    return stop


def thread_cpu(pid):
    """(thread id, name) -> CPU seconds, of each live thread (names written by thread_names/).
    By id: a thread that ended and another of its name started since (a full run's scan
    thread) are two threads."""
    threads = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended since the listing
            continue
        threads[tid, name] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return threads


class CpuWindow:
    """One measurement window over every tree's exporter at once: the process's CPU, and
    each thread's by name (what ended in the window is the remainder: the full runs' scan
    threads, mostly)."""

    def __init__(self, exporters):
        self.exporters = exporters
        self.began = time.monotonic()
        self.total = {name: cpu_seconds(e.proc.pid) for name, e in exporters.items()}
        self.threads = {name: thread_cpu(e.proc.pid) for name, e in exporters.items()}

    def shares(self):
        """tree -> (% of a core in all, [(thread, % of a core)] largest first)."""
        took = time.monotonic() - self.began
        result = {}
        for name, e in self.exporters.items():
            total = cpu_seconds(e.proc.pid) - self.total[name]
            before, after = self.threads[name], thread_cpu(e.proc.pid)
            per = {}
            for (tid, thread), seconds in after.items():  # summed by name
                per[thread] = per.get(thread, 0.0) + seconds - before.get((tid, thread), 0.0)
            per["(ended)"] = total - sum(per.values())
            ranked = sorted(((t, 100 * v / took) for t, v in per.items()), key=lambda tv: -tv[1])
            result[name] = (100 * total / took, ranked)
        return result


def cpu_figure_rows(what, window, goal):
    rows = []
    for tree, (share, threads) in window.shares().items():
        rows.append((f"{what} [{tree}]", f"{share:.2f} % of a core", "-", "-", goal))
        rows.append((f"  per thread [{tree}]", ", ".join(f"{t} {v:.2f}" for t, v in threads if v >= 0.01),
                     "-", "-", "-"))
    return rows


def cpu_rows(seconds, idle_seconds=120.0, trees=((".", REPO),)):
    """`trees`: (name, checkout) pairs; every tree's exporter runs at once on the same pods,
    so each window's load is the same for all (the old code beside the new, in one run)."""
    rows = []
    env = {"PYTHONPATH": os.path.join(HERE, "thread_names")}
    with Pods(200) as pods, ExitStack() as stack:
        pods.start_processes(2000)
        exporters = {name: stack.enter_context(ours(tree=where, env=env)) for name, where in trees}
        time.sleep(35)  # past the first inventory intervals
        # Nobody scraping: collection alone (renders happen only for scrapes).
        window = CpuWindow(exporters)
        churn(pods, seconds)
        rows += cpu_figure_rows("node mode churn CPU, 10 creates/s over 200 pods, 2,000 processes, no scraper",
                                window, "<= 5 %")
        scraping = [prometheus_scraping(e) for e in exporters.values()]
        # Whole full-scan intervals (--segments.full-scan-interval, 2m): each holds one
        # read of every process, the refreshes between them far less.
        window = CpuWindow(exporters)
        time.sleep(idle_seconds)
        rows += cpu_figure_rows(f"node mode idle CPU over {idle_seconds:.0f} s, 200 pods, 2,000 processes, "
                                "scraped every 15 s", window, "<= 1.5 %")
        window = CpuWindow(exporters)
        churn(pods, seconds)
        rows += cpu_figure_rows("node mode churn CPU, 10 creates/s over 200 pods, 2,000 processes, "
                                "scraped every 15 s", window, "<= 5 %")
        for stop in scraping:
            stop.set()
        for name, exporter in exporters.items():
            lat = []
            # A new segment is counted from the first scrape after the debounced event-driven
            # run: the scraper here asks every 25 ms, so this is create -> observation.
            churn(pods, seconds, watch=(exporter, lat))
            rows.append((f"node mode churn detection, create -> counted in /metrics [{name}]",
                         f"p50 {percentile(lat, 50) * 1000:.0f} ms, p99 {percentile(lat, 99) * 1000:.0f} ms "
                         f"({len(lat)} creates)", "-", "-", "p99 <= 1 s"))
    return rows


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=120,
                        help="churn and detection measurement: whole full-scan intervals")
    parser.add_argument("--idle-seconds", type=float, default=120, help="idle measurement: whole full-scan intervals")
    parser.add_argument("--scrapes", type=int, default=300)
    parser.add_argument("--only", choices=("scrape", "cpu"))
    parser.add_argument("--tree", action="append",
                        help="CPU rows: directory or git revision; each tree's exporter beside the others")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs and creates cgroups")
    sys.path.insert(0, HERE)
    # `timeout` or a CI's cancel: unwind, so the pods' mounts and cgroups are removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    rows = [] if args.only == "cpu" else scrape_rows(args.scrapes)
    if args.only != "scrape":
        from leak_storm_rss import checkout  # a git revision archived, as the storm bench does

        with ExitStack() as stack:
            trees = [(tree, checkout(tree, stack)) for tree in args.tree] if args.tree else [(".", REPO)]
            rows += cpu_rows(args.seconds, args.idle_seconds, trees)
    for row in rows:
        print(" | ".join(row))


if __name__ == "__main__":
    main()
