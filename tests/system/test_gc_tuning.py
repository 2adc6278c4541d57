"""serve (exporter/cli.py) runs the cyclic collector only after 50,000 net new objects. That is
safe because serving makes no garbage cycles: this checks it on the real serve path (an App,
its HTTP server, inotify events and quick runs on a real tmpfs, a peer holding segments,
scrapes in both formats), with automatic collection off so nothing hides a cycle."""
import gc
import gzip
import os
import subprocess
import time
import types
import uuid
import urllib.request

from exporter import cli
from exporter.app import App
from exporter.config import parse_args
from exporter.exposition.http import bind, make_app
from tests.conftest import Peer, mounted_tmpfs, needs_root, remove_cgroup, stop_process
from tests.conftest import prerequisite_missing
from tests.helpers import V1_MEMORY, into_pod

ACCEPTS = ("text/plain;version=0.0.4", "application/openmetrics-text;version=1.0.0")


def test_tune_raises_only_the_youngest_generations_threshold():
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 7, 9)
        cli.tune_process()
        assert gc.get_threshold() == (cli.GC_GEN0_THRESHOLD, 7, 9)
    finally:
        gc.set_threshold(*before)


@needs_root
def test_serving_makes_no_garbage_cycles(tmpfs):
    serve_and_count_garbage(tmpfs, [f"--shm.mount={tmpfs}"], None)


@needs_root
def test_serving_a_node_makes_no_garbage_cycles(tmp_path):
    """Node mode's own paths: discovery of a pod's volume, pod-scoped quick runs (the peer in
    the pod's memory cgroup), full scans every second (with the early publishes of events
    landing during them), SysV read in each IPC namespace (the pod's own, made by
    `unshare --ipc`: 2226ecf's sidecar-only test missed a cycle per setns), cgroups and the
    kernel log."""
    if not os.path.exists(os.path.join(V1_MEMORY, "cgroup.procs")):
        prerequisite_missing(f"needs the cgroup v1 memory controller at {V1_MEMORY} to put the peer in a pod cgroup")
    uid = str(uuid.uuid4())
    cgroup = os.path.join(V1_MEMORY, "kubepods", "burstable", f"pod{uid}")
    path = f"{tmp_path}/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm"
    os.makedirs(cgroup)
    try:
        with mounted_tmpfs("16m", path=path), subprocess.Popen(["unshare", "--ipc", "sleep", "60"]) as sandbox:
            try:
                into_pod(cgroup, sandbox.pid)
                host, deadline = os.readlink("/proc/self/ns/ipc"), time.monotonic() + 5
                while (namespace := os.readlink(f"/proc/{sandbox.pid}/ns/ipc")) == host:  # unshare(2) not yet run
                    assert time.monotonic() < deadline, "unshare --ipc made no namespace"
                    time.sleep(0.01)
                body, runs = serve_and_count_garbage(path, ["--mode=node", "--segments.full-scan-interval=1s",
                                                      "--inventory-interval=1s"], cgroup)
                # what it served came from those paths: the pod's volume, its own namespace, full
                # and quick runs
                assert {True, False} <= runs, runs
                # The pod's mount by its pod_uid and volume (no path, no empty label).
                assert f'shmwatch_segments{{class="nccl",pod_uid="{uid}",state="linked",volume="dshm"}}' in body
                assert f'ipc_namespace="{namespace}",pod_uid="{uid}"' in body
            finally:
                stop_process(sandbox)
    finally:
        remove_cgroup(cgroup)


def serve_and_count_garbage(mount, args, cgroup):
    app = App(parse_args(args + ["--no-collector.gpu", "--log.level=error"]))
    runs = set()  # what kinds of segments runs served
    app.sampler.subscribe(lambda obs: runs.add(obs.full) if obs.source == "segments" else None)
    httpd = bind("127.0.0.1", 0, make_app(app.exposition.wsgi_app))
    httpd.start()
    url = "http://127.0.0.1:%d/metrics" % httpd.server_address[1]
    enabled = gc.isenabled()
    app.start()
    try:
        with Peer(mount, "mapped", "nccl-gc01", str(1 << 20)) as peer:
            if cgroup:
                into_pod(cgroup, peer.pid)
            assert app.sampler.wait_for_first_run(10)
            time.sleep(1.0)  # past start-up: the first runs and renders
            gc.disable()
            gc.collect()
            for i in range(40):  # creates and deletes: quick runs, renders, scrapes
                path = os.path.join(mount, f"psm_gc{i:03d}")
                with open(path, "wb") as f:
                    f.write(b"x" * 4096)
                if i % 3 == 0:
                    os.unlink(path)
                request = urllib.request.Request(url, headers={"Accept": ACCEPTS[i % 2], "Accept-Encoding": "gzip"})
                with urllib.request.urlopen(request, timeout=5) as response:
                    assert response.status == 200
                    body = gzip.decompress(response.read()).decode()
                time.sleep(0.05)
            time.sleep(1.5)  # a poll, its render and a full inventory at least
            garbage = gc.collect()
    finally:
        if enabled:
            gc.enable()
        app.stop()
        httpd.shutdown()
    assert app.exposition.renders > 5
    assert garbage == 0, f"{garbage} objects in garbage cycles: cli.tune_process's gc threshold assumes none"
    return body, runs


@needs_root
def test_an_ipc_namespace_that_cannot_be_read_makes_no_garbage_cycle():
    """Node mode's SysV run reads each pod's IPC namespace in a thread of its own; one it
    cannot read (setns refused, /proc/sysvipc unreadable) is handed back as its error. Kept
    with its traceback, that error held the thread's frame, and so the results holding it:
    a cycle per namespace and run."""
    from exporter.collectors.sysv import IpcNamespace, in_ipc_namespaces

    def refused():
        raise PermissionError(13, "Permission denied")

    own = os.readlink("/proc/self/ns/ipc")
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what a collection finds stays in gc.garbage, to look at
    try:
        gc.collect()
        gc.garbage.clear()
        read = in_ipc_namespaces([IpcNamespace(namespace=own, links=["/proc/self/ns/ipc"])], refused)
        assert isinstance(read[own], PermissionError)
        del read
        gc.collect()
        # Threads left by other tests in this process may make garbage meanwhile: only what this
        # run made counts (its error, or a frame of the namespace thread or of `refused`).
        ours = [o for o in gc.garbage if isinstance(o, PermissionError)
                or (isinstance(o, types.FrameType) and o.f_code.co_filename.endswith("sysv.py"))
                or (isinstance(o, types.FrameType) and o.f_code is refused.__code__)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert not ours, f"{len(ours)} of this run's objects in garbage cycles: {ours[:5]}"
