#!/usr/bin/env python3
"""Render grafana/preview.png: the dashboard's main panels, queried from a live Prometheus.

Sets up what the live dashboard test does (a real tmpfs, real processes holding, hiding
and leaking segments, shmwatch, Prometheus), plays ~80 s of activity, then draws the
main panels' own queries (taken from grafana/shmwatch.json) with matplotlib.

    sudo python3 grafana/render_preview.py        # needs: pip install matplotlib
"""
import json
import os
import sys
import tempfile
import time
import urllib.parse
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from tests.conftest import Exporter, Peer, fallocate, mounted_tmpfs  # noqa: E402
from tests.live import Prometheus, fast_rules  # noqa: E402
from tests.system.test_dashboard import DASHBOARD, substitute  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "preview.png")
PANELS = ["Used, size, effective size, peak", "Bytes by owner class", "Bytes by state",
          "Container memory: working set vs limit, with the shm part", "Segments by class", "Largest segments"]
MiB = 1 << 20


def query_range(prom, expr, start, end):
    url = f"{prom.url}/api/v1/query_range?" + urllib.parse.urlencode(
        {"query": expr, "start": start, "end": end, "step": "1s"})
    with urllib.request.urlopen(url, timeout=30) as response:
        return json.load(response)["data"]["result"]


def legend(template, labels):
    out = template
    for key, value in labels.items():
        out = out.replace("{{" + key + "}}", value)
    return out if out != "__auto" else ",".join(f"{k}={v}" for k, v in labels.items() if k != "__name__")


def scenario(shm):
    """80 s of a serving pod's life: engines start, NCCL hides its segments, a crash leaks some."""
    holders = [Peer(shm, "psm", str(2 * MiB)), Peer(shm, "mapped", "nccl-a1b2c3", str(4 * MiB))]
    time.sleep(10)
    holders.append(Peer(shm, "hidden", "nccl-d4e5f6", str(6 * MiB)))
    holders.append(Peer(shm, "mapped", "torch_4242_77", str(3 * MiB)))
    time.sleep(10)
    for _ in range(3):
        with Peer(shm, "leak", str(2 * MiB)) as leak:  # a crashed engine's leftovers
            leak.proc.wait(10)
        time.sleep(3)
    fallocate(os.path.join(shm, "sem.mp-xyz"), 4096)
    time.sleep(10)
    spike = os.path.join(shm, "psm_batch")
    fallocate(spike, 24 * MiB)  # a burst of multimodal inputs
    time.sleep(2)
    os.unlink(spike)
    time.sleep(20)
    holders[0].close()
    time.sleep(10)
    return holders


def main():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(DASHBOARD) as f:
        panels = {p["title"]: p for p in json.load(f)["panels"] if p["type"] != "row"}
    with tempfile.TemporaryDirectory() as work, mounted_tmpfs("64m") as shm:
        rules = os.path.join(work, "rules.yml")
        fast_rules(rules)
        with Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--memory.limit-bytes=1Gi",
                      "--peak-window=30s") as exporter, \
                Prometheus(work, [f"127.0.0.1:{exporter.port}"], rules=rules) as prom:
            start = time.time()
            holders = scenario(shm)
            end = time.time()
            time.sleep(2)
            data = {t: [(legend(tg["legendFormat"], s["metric"]), s["values"])
                        for tg in panels[t]["targets"]
                        for s in query_range(prom, substitute(tg["expr"], shm), start, end)] for t in PANELS}
            for h in holders:
                h.close()

    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    for ax, title in zip(axes.flat, PANELS):
        series = data[title]
        unit = panels[title]["fieldConfig"]["defaults"].get("unit")
        scale, ylabel = (MiB, "MiB") if unit == "bytes" else (1, unit or "")
        ax.set_title(title, fontsize=10)
        if title == "Largest segments":
            # The table is an instant query: only segments that still exist at the end.
            alive = [(float(vals[-1][1]), name) for name, vals in series if float(vals[-1][0]) >= end - 3]
            last = sorted(alive, reverse=True)[:8]
            labels = [n.split("name=")[-1].split(",")[0][:30] + "  (" + n.split("state=")[-1].split(",")[0] + ")"
                      for _, n in last]
            ax.barh(labels[::-1], [v / MiB for v, _ in last][::-1], color="#5794f2")
            ax.set_xlabel("MiB")
            continue
        stacked = panels[title]["fieldConfig"]["defaults"].get("custom", {}).get("stacking", {}).get("mode") == "normal"
        if stacked and series:
            times = [float(t) - start for t, _ in series[0][1]]
            ys = []
            for _name, vals in series:
                lookup = {float(t): float(v) / scale for t, v in vals}
                ys.append([lookup.get(float(t) , 0.0) for t, _ in series[0][1]])
            ax.stackplot(times, ys, labels=[n for n, _ in series], alpha=0.7)
        else:
            for name, vals in series:
                ax.plot([float(t) - start for t, _ in vals], [float(v) / scale for _, v in vals], label=name)
        ax.set_xlabel("seconds")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, loc="upper left")
    fig.suptitle("shmwatch dashboard, main panels (live Prometheus, real tmpfs and processes)", fontsize=13)
    fig.tight_layout()
    fig.savefig(OUT, dpi=80)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
