"""The dashboard's $namespace/$pod name the workload pod in both shapes, proven on a real Prometheus.

Sidecar: the scrape's namespace/pod target labels are the workload's. Node mode (DaemonSet):
they are the DaemonSet's own pod, and a pod's series carry pod_uid, named by the recording
rule shmwatch:pod_info from kube-state-metrics' kube_pod_info. Three Prometheus servers
scrape hand-written series of both shapes (honor_labels: each line names its exporter):

- "full": a sidecar beside vllm-0; two node-mode exporters (one on the node of sglang-1, one
  on the node of trainer-0), each with its node series (host memory, GPU, its own health)
  and its host series (host /dev/shm, cgroups and IPC namespace of no pod, pod_uid="");
  kube_pod_info of every pod, the DaemonSet's own included.
- "sidecar": only the sidecar's series; "node": only what belongs to sglang-1 (its pod
  series, and the node series of the exporter on its node).

Every query of every panel, with $pod=vllm-0, must return exactly what it returns from
"sidecar", and with $pod=sglang-1 exactly what it returns from "node": the other shape, the
DaemonSet's target labels, the host's series and the other node add nothing, and neither
answer is empty. The pod and namespace lists name the workloads, never the DaemonSet.
"""
import contextlib
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml

from exporter.model.catalogue import CATALOGUE, node_labels
from tests.conftest import REPO
from tests.live import Prometheus
from tests.system.test_dashboard import load, panels

RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")
NODE_RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-node-rules.yml")
RECOMMEND_RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-recommend-rules.yml")

SIDECAR = {"job": "shmwatch", "instance": "10.0.0.5:9090", "namespace": "llm", "pod": "vllm-0"}
NODE_A = {"job": "shmwatch-node", "instance": "10.0.1.9:9090", "namespace": "shmwatch", "pod": "shmwatch-node-abc"}
NODE_B = {"job": "shmwatch-node", "instance": "10.0.2.9:9090", "namespace": "shmwatch", "pod": "shmwatch-node-xyz"}
# kube-state-metrics: (namespace, pod, uid, node)
PODS = [("llm", "vllm-0", "v0", "a"), ("llm", "sglang-1", "u1", "a"), ("batch", "trainer-0", "u2", "b"),
        ("shmwatch", "shmwatch-node-abc", "ds-a", "a"), ("shmwatch", "shmwatch-node-xyz", "ds-b", "b")]
# A value for every catalogue label that says nothing about where a series comes from.
FILL = {"class": "nccl", "event": "create", "gpu": "0", "uuid": "GPU-0", "comm": "python3",
        "name": "nccl-1", "owner": "python3", "type": "dir", "collector": "shm", "version": "0.0.0",
        "fstype": "tmpfs", "source": "tmpfs", "driver_version": "550"}


def line(name, labels, value=1):
    return name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}" + f" {value}"


def exporter(target, kind, uid=""):
    """One exporter's series. kind: "sidecar" (every metric, no node labels); node mode's
    "node" (metrics no pod_uid names), "pod" (a pod's, pod_uid=uid: its mount by its volume,
    its cgroup by its pod_uid alone), "host" (pod_uid="")."""
    lines = []
    for metric in CATALOGUE:
        per_pod = "pod_uid" in node_labels(metric)
        if not metric.name.startswith("shmwatch_") or (kind == "node" and per_pod) \
                or (kind in ("pod", "host") and not per_pod):
            continue
        labels = dict(target, **{k: FILL[k] for k in metric.labels if k in FILL})
        if metric.name == "shmwatch_cgroup_memory_events_total":  # the memory.high panel draws throttled cgroups
            labels["event"] = "high"
        if kind in ("pod", "host"):
            labels.update({k: "" for k in node_labels(metric)}, pod_uid=uid)
            labels.update({"volume": "dshm"} if "volume" in labels and uid else {})
            labels.update({"ipc_namespace": f"ipc-{uid or 'host'}"} if "ipc_namespace" in labels else {})
            labels.update({"process_pod_uid": uid} if "process_pod_uid" in labels else {})
        if "mount" in metric.labels and kind != "pod":
            labels["mount"] = "/dev/shm"
        if "cgroup" in metric.labels and kind != "pod":
            labels["cgroup"] = {"sidecar": "/", "host": "/system.slice"}[kind]
        # The panel counts namespaces shmwatch could not read; the host's it always can.
        value = int(kind == "host") if metric.name == "shmwatch_sysv_namespace_readable" else 1
        for state in (("orphan", "hidden") if "state" in metric.labels else (None,)):
            lines.append(line(metric.name, dict(labels, **({"state": state} if state else {})), value))
    alert = {"alertstate": "firing", "severity": "warning"}
    if kind == "sidecar":
        lines.append(line("ALERTS", dict(target, alertname="ShmUsageHigh", mount="/dev/shm", **alert)))
    elif kind == "pod":
        lines.append(line("ALERTS", dict(target, alertname="ShmUsageHigh", pod_uid=uid, volume="dshm", **alert)))
    elif kind == "host":
        lines.append(line("ALERTS", dict(target, alertname="ShmUsageHigh", mount="/dev/shm", pod_uid="",
                                         volume="", container_id="", **alert)))
    else:
        lines.append(line("ALERTS", dict(target, alertname="HostMemoryLow", **alert)))
    return lines


KSM = [line("kube_pod_info", {"job": "kube-state-metrics", "instance": "10.0.9.9:8080", "namespace": ns, "pod": pod,
                              "uid": uid, "node": node}) for ns, pod, uid, node in PODS]
WORLDS = {
    "full": exporter(SIDECAR, "sidecar") + exporter(NODE_A, "node") + exporter(NODE_A, "pod", "u1")
    + exporter(NODE_A, "host") + exporter(NODE_B, "node") + exporter(NODE_B, "pod", "u2")
    + exporter(NODE_B, "host") + KSM,
    "sidecar": exporter(SIDECAR, "sidecar") + KSM,
    "node": exporter(NODE_A, "node") + exporter(NODE_A, "pod", "u1") + KSM,
}


@contextlib.contextmanager
def serving(text):
    body = text.encode()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def rules_file(path):
    """The ratios, the node-mode joins and the recommendation records (evaluated every second here)."""
    groups = []
    for source in (RULES, NODE_RULES, RECOMMEND_RULES):
        with open(source) as f:
            groups += yaml.safe_load(f)["groups"]
    for group in groups:
        group["interval"] = "1s"
        group["rules"] = [r for r in group["rules"] if "record" in r]
    path.write_text(yaml.safe_dump({"groups": groups}))
    return str(path)


def substitute(expr, pod, namespace=".*", job=".*"):
    """Grafana's variables: one pod selected, every other variable on All (".*")."""
    for name, value in (("$__rate_interval", "1m"), ("$job", job), ("$instance", ".*"),
                        ("$namespace", namespace), ("$pod", pod), ("$mount", ".*")):
        expr = expr.replace(name, value)
    assert "$" not in expr, f"a variable this test does not know: {expr}"
    return expr


def answer(prom, expr):
    return sorted((tuple(sorted(r["metric"].items())), r["value"][1]) for r in prom.query(expr))


def settle(prom, exprs, timeout=30.0):
    """Wait for the rules' first evaluations and two scrapes (rate needs both): every query answers."""
    for expr in exprs:
        prom.wait_query(expr, timeout=timeout)


def variable_values(prom, variable, **values):
    """What Grafana lists for a query_result variable: its regex over each result line
    (metric{label="value", ...} value timestamp, as Grafana's metricFindQuery writes it)."""
    query = variable["query"]["query"]
    inner = re.fullmatch(r"query_result\((.*)\)", query, re.S).group(1)
    regex = re.fullmatch(r"/(.*)/", variable["regex"]).group(1)
    found = set()
    for r in prom.query(substitute(inner, values.get("pod", ".*"), values.get("namespace", ".*"))):
        text = "{" + ", ".join(f'{k}="{v}"' for k, v in r["metric"].items() if k != "__name__") + "} 1 0"
        match = re.search(regex, text)
        if match:
            found.add(match.group(1))
    return found


def test_pod_filter_names_the_workload_in_sidecar_and_node_mode(tmp_path):
    dashboard = load()
    targets = [(p["title"], t["expr"]) for p in panels(dashboard) for t in p["targets"]]
    assert len(targets) >= 40, "every panel's every query is checked"
    rules = rules_file(tmp_path / "rules.yml")
    with contextlib.ExitStack() as stack:
        proms = {}
        for world, lines in WORLDS.items():
            target = stack.enter_context(serving("\n".join(sorted(lines)) + "\n"))
            workdir = tmp_path / world
            workdir.mkdir()
            proms[world] = stack.enter_context(Prometheus(str(workdir), [target], rules=rules, honor_labels=True))
        cases = (("vllm-0", "sidecar"), ("sglang-1", "node"))
        for pod, world in cases:
            settle(proms[world], [substitute(e, pod) for _, e in targets])
            settle(proms["full"], [substitute(e, pod) for _, e in targets])
        wrong = []
        for title, expr in targets:
            for pod, world in cases:
                got, want = answer(proms["full"], substitute(expr, pod)), answer(proms[world], substitute(expr, pod))
                if got != want or not want:
                    wrong.append(f"{title} ($pod={pod}): {expr}\n  got  {got}\n  want {want}")
                # A pod's series are labelled with the workload, not the DaemonSet (node series,
                # which no pod_uid names, keep their exporter's labels).
                for labels, _ in got:
                    labels = dict(labels)
                    if (labels.get("pod_uid") or world == "sidecar") and "pod" in labels \
                            and (labels["pod"], labels.get("namespace")) != (pod, "llm"):
                        wrong.append(f"{title} ($pod={pod}): labelled {labels}")
        assert not wrong, "\n".join(wrong)
        # And the old bug: the DaemonSet's pod, selected by hand, is not what a node-mode pod panel shows.
        ratio = next(e for t, e in targets if t == "/dev/shm usage")
        assert answer(proms["full"], substitute(ratio, "sglang-1")) == [((("volume", "dshm"),), "1")]

        variables = {v["name"]: v for v in dashboard["templating"]["list"]}
        full = proms["full"]
        assert variable_values(full, variables["namespace"]) == {"llm", "batch"}
        assert variable_values(full, variables["pod"]) == {"vllm-0", "sglang-1", "trainer-0"}
        assert variable_values(full, variables["pod"], namespace="llm") == {"vllm-0", "sglang-1"}
        assert variable_values(proms["sidecar"], variables["pod"]) == {"vllm-0"}
        assert variable_values(proms["node"], variables["pod"]) == {"sglang-1"}


@pytest.mark.parametrize("name", ["namespace", "pod"])
def test_workload_variables_are_query_results_with_a_regex(name):
    variable = next(v for v in load()["templating"]["list"] if v["name"] == name)
    assert variable["query"]["query"].startswith("query_result(") and variable["regex"] == f'/{name}="([^"]+)"/'
    assert variable["definition"] == variable["query"]["query"] and variable["allValue"] == ".*"
