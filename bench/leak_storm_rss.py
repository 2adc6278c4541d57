#!/usr/bin/env python3
"""A shmwatch process's resident memory through a leak storm (run as root: it mounts tmpfs).

For each tree and each storm size: a fresh tmpfs and a fresh `shmwatch` (sidecar defaults,
no GPU collector), RSS before, N empty files made (scraped every 10,000), counted, deleted,
then a minute of scrapes once a second; prints RSS before, with the files, the peak (VmHWM),
`--settle` seconds after the exporter saw them gone, and how many seconds after that RSS was
back within the target of before (and stayed: "-" never).

    sudo python3 bench/leak_storm_rss.py [--files 100000 300000] [--tree main --tree .]
        [--idle 120]

With --idle, first the steady state's cost, every tree's exporter at once (the same load on
each): 1,000 files, scraped every 15 s, CPU and RSS over that many seconds.

A --tree is a directory holding `exporter/`, or a git revision of this repository (archived to
a temporary directory): `--tree main --tree .` is the old code beside the new, in one run.
Target: after - before <= 12 MiB within 60 s; peak <= 96 MiB (the sidecar manifest's limit).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from typing import Dict, List, Tuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import REPO, Exporter, mounted_tmpfs  # noqa: E402
from tests.helpers import StormRss, leak_storm, make_files, status_mib  # noqa: E402

TARGET_AFTER_MIB, LIMIT_MIB = 12, 96


def checkout(tree: str, stack: ExitStack) -> str:
    """A directory holding `exporter/`: `tree` itself, or the git revision it names."""
    if os.path.isdir(os.path.join(tree, "exporter")):
        return os.path.abspath(tree)
    where = stack.enter_context(tempfile.TemporaryDirectory(prefix="shmwatch-bench-"))
    archive = subprocess.run(
        ["git", "-C", REPO, "archive", tree], check=True, capture_output=True
    )
    subprocess.run(["tar", "-x", "-C", where], input=archive.stdout, check=True)
    return where


def storm(tree: str, files: int, settle: float) -> StormRss:
    inodes = f",nr_inodes={files + 10_000}"
    with mounted_tmpfs("64m", options=inodes) as shm:
        args = (f"--shm.mount={shm}", "--no-collector.gpu", "--log.level=error")
        with Exporter(*args, tree=tree) as exporter:
            return leak_storm(exporter, shm, files, settle)


def back_at(r: StormRss) -> str:
    """Seconds after the files were gone until RSS was within the target of before, and stayed."""
    late = [t for t, rss in r.trace if rss - r.before > TARGET_AFTER_MIB]
    if not late:
        return "0"
    later = [t for t, _ in r.trace if t > late[-1]]
    return f"{later[0]:g}" if later else "-"


def cpu_seconds(exporter: Exporter) -> float:
    assert exporter.proc is not None
    with open(f"/proc/{exporter.proc.pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle(trees: List[Tuple[str, str]], seconds: float) -> None:
    """Each tree's exporter beside the others on 1,000 files, scraped every 15 s."""
    with ExitStack() as stack:
        running: Dict[str, Exporter] = {}
        for name, where in trees:
            shm = stack.enter_context(mounted_tmpfs("64m"))
            make_files(shm, [f"psm_{i:05d}" for i in range(1000)])
            args = (f"--shm.mount={shm}", "--no-collector.gpu", "--log.level=error")
            running[name] = stack.enter_context(Exporter(*args, tree=where))
        time.sleep(20)  # past the first inventories
        started = {name: cpu_seconds(e) for name, e in running.items()}
        began = time.monotonic()
        while time.monotonic() - began < seconds:
            for exporter in running.values():
                exporter.scrape_text()
            time.sleep(15)
        took = time.monotonic() - began
        print(
            f"steady state, 1,000 files, scraped every 15 s, {took:.0f} s side by side:"
        )
        for name, e in running.items():
            share = (cpu_seconds(e) - started[name]) / took * 100
            assert e.proc is not None
            rss = status_mib(e.proc.pid, "VmRSS")
            print(f"  {name:<12} CPU {share:.2f} % of a core, RSS {rss:.1f} MiB")


def row(name: str, r: StormRss) -> str:
    grew = r.after - r.before
    verdict = "ok" if grew <= TARGET_AFTER_MIB and r.peak <= LIMIT_MIB else "MISSED"
    return (
        f"{name:<12} {r.files:>8,} {r.before:>8.1f} {r.full:>8.1f} {r.peak:>8.1f}"
        f" {r.after:>8.1f} {grew:>+8.1f} {back_at(r):>8}  {verdict}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, nargs="+", default=[100_000, 300_000])
    parser.add_argument("--tree", action="append", help="directory or git revision")
    parser.add_argument("--settle", type=float, default=60.0, help="seconds after")
    parser.add_argument("--rounds", type=int, default=1, help="each tree, interleaved")
    parser.add_argument(
        "--idle", type=float, default=0, help="seconds of steady state first"
    )
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the benchmark mounts tmpfs")
    results: List[Tuple[str, StormRss]] = []
    with ExitStack() as stack:
        trees = [(t, checkout(t, stack)) for t in args.tree or ["."]]
        if args.idle:
            idle(trees, args.idle)
        for _ in range(args.rounds):
            for files in args.files:
                for name, where in trees:
                    results.append((name, storm(where, files, args.settle)))
                    print(row(name, results[-1][1]), file=sys.stderr, flush=True)
    print(
        f"leak storm RSS (MiB); 'after' is {args.settle:g} s after the files were gone"
    )
    head = ("tree", "files", "before", "full", "peak", "after", "grew", "back at")
    print(f"{head[0]:<12}" + "".join(f" {h:>8}" for h in head[1:]))
    for name, r in results:
        print(row(name, r))


if __name__ == "__main__":
    main()
