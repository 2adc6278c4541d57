"""Tests of exporter/check/report_decisions.py."""

from types import SimpleNamespace

from exporter.check import thresholds as T
from exporter.check.findings import Report
from exporter.check.recommend import settings_for
from exporter.check.report import diagnose, shm, shm_remedy
from exporter.model.step import Model, MountView, SourceStatus
from exporter.model.summary import shm_budget, summarise
from exporter.model.types import CgroupMemory, GpuDevice, GpuSnapshot, HostMemory, Inventory, MountInventory, MountUsage
from tests.helpers import GiB, MiB, cgroup, inventory, seg, usage, view


# --- `shmwatch check`: thresholds and advice --------------------------------------------------
def judge(u, required=None, cg=None, budget_memory=None, inventory=None):
    report = Report()
    v = view(u, cg, budget_memory=budget_memory)
    if inventory is not None:
        v = MountView(v.mount, {}, u, None, None, None, inventory, summarise(inventory, 5), cg, v.budget)
    model = SimpleNamespace(inventory=Inventory([], {}, 0, 1, wall_time=10_000.0))
    shm(report, v, model, required)
    return report


def severities(report):
    return [(f.severity, f.message) for f in report.findings]


def test_require_shm_compares_the_effective_size():
    """2 GiB of tmpfs under a 512 MiB memory limit holds 512 MiB: --require-shm=1Gi fails."""
    r = judge(usage(2 * GiB, 0), 1 * GiB, budget_memory=512 * MiB)
    [(severity, message)] = severities(r)
    assert severity == "fail" and message == "2.0 GiB, 0 B used (0%): can hold 512.0 MiB, below the 1.0 GiB required (--require-shm)"
    assert r.exit_code == 2 and r.facts["shm"][0]["effective_size_bytes"] == 512 * MiB
    assert r.findings[0].remedy == shm_remedy(1 * GiB)
    assert judge(usage(2 * GiB, 0), 512 * MiB, budget_memory=512 * MiB).exit_code == 0  # exactly enough
    assert judge(usage(2 * GiB, 0), 512 * MiB + 1, budget_memory=512 * MiB).exit_code == 2


def test_usage_thresholds_are_the_rules():
    size = 1000 * MiB
    assert judge(usage(size, int(size * T.SHM_USAGE_WARNING_RATIO))).exit_code == 0
    warn = judge(usage(size, int(size * T.SHM_USAGE_WARNING_RATIO) + MiB))
    assert severities(warn) == [("warn", "1000.0 MiB, 801.0 MiB used (80%): above 80 %")]
    assert warn.findings[0].remedy == "remove leaked segments or raise the size"
    full = judge(usage(size, int(size * T.SHM_USAGE_CRITICAL_RATIO) + MiB))
    assert [s for s, _ in severities(full)] == ["warn"] and "about to be full" in full.findings[0].message
    assert judge(usage(size, int(size * T.SHM_USAGE_CRITICAL_RATIO) + MiB), required=MiB).exit_code == 2
    assert judge(usage(size, int(size * T.SHM_USAGE_CRITICAL_RATIO))).findings[0].message.endswith("above 80 %")


def test_docker_default_and_fstype():
    small = judge(usage(64 * MiB, 0))
    assert severities(small) == [("warn", "64.0 MiB (Docker's 64 MiB default), 0 B used (0%): far too small "
                                          "for NCCL, torch or vLLM")]
    assert small.findings[0].remedy == shm_remedy(16 * GiB)
    below = judge(usage(32 * MiB, 0))
    assert "32.0 MiB (below Docker's 64 MiB default)" in below.findings[0].message
    assert severities(judge(usage(64 * MiB + 4096, 0)))[0][0] == "ok"
    other = Report()
    u = MountUsage("/dev/shm", "ext4", "/dev/vda", True, size_bytes=GiB, used_bytes=0)
    shm(other, view(u), None, None)
    assert [(f.severity, f.message) for f in other.findings] == [("warn", "is ext4, not tmpfs")]
    error = Report()
    shm(error, view(MountUsage("/x", "tmpfs", "t", False, error="gone")), None, 1)
    assert [(f.severity, f.message) for f in error.findings] == [("fail", "cannot be measured: gone")]


def test_leaks_are_advised_for_removal_only_when_removable():
    inv = inventory("/dev/shm", [
        seg("nccl-a", "nccl", "orphan", 2 * MiB, mtime=9_000.0), seg("lock", "other", "orphan", 4096),
        seg("psm_u", "python_shm", "unverified", MiB), seg("torch_h", "torch", "hidden", MiB, holders=(3,))])
    r = judge(usage(GiB, 4 * MiB), inventory=inv)
    by_severity = {(f.severity, f.message.split(":")[0]): f.remedy for f in r.findings}
    assert by_severity[("warn", "1 leaked segment(s) held by no process, 2.0 MiB")] == \
        "once no server can attach to them: rm -- /dev/shm/nccl-a"
    assert ("info", "1 file(s) of no known owner class held by no process, 4.0 KiB") in by_severity
    unverified = next(f for f in r.findings if "could not read 0 process(es))" in f.message)
    assert unverified.severity == "info" and "never remove them" in unverified.remedy
    hidden = next(f for f in r.findings if "unlinked-but-mapped" in f.message)
    assert hidden.message.startswith("1 unlinked-but-mapped segment(s), 1.0 MiB")
    facts = r.facts["shm"][0]
    assert facts["orphans"] == [{"name": "nccl-a", "class": "nccl", "bytes": 2 * MiB, "age_seconds": 1000},
                                {"name": "lock", "class": "other", "bytes": 4096, "age_seconds": 10_000}]
    assert facts["unverified"] == [{"name": "psm_u", "class": "python_shm", "bytes": MiB}]
    assert r.findings[0].severity == "ok"
    assert "by class: nccl 2.0 MiB, torch 1.0 MiB, python_shm 1.0 MiB, other 4.0 KiB" in r.findings[0].message


def model_of(views, cgroups, host=None, node_mode=False, statuses=()):
    return Model(node_mode, list(statuses), views, None, cgroups, host, [], None, [], None)


def test_memory_thresholds_and_the_projection():
    cg = cgroup(int(400 * MiB * T.OOM_RISK_RATIO) + MiB, 400 * MiB)
    u = usage(2 * GiB, 60 * MiB)
    report = diagnose(model_of([view(u, cg)], [cg]))
    memory = [(f.severity, f.subject, f.message) for f in report.findings if f.area == "memory"]
    assert ("warn", "/c", "working set 361.0 MiB of 400.0 MiB limit (90%)") in memory
    projection = next(f for f in report.findings if f.subject == "/dev/shm" and f.area == "memory")
    assert projection.message.startswith("filling it (2.0 GiB) would need 587% of the memory limit")
    assert projection.remedy == "lower sizeLimit to at most 99.0 MiB or raise the memory limit"
    calm = cgroup(int(400 * MiB * T.OOM_RISK_RATIO), 400 * MiB)
    # 300 MiB besides shm, and a full 100 MiB mount: exactly the limit, not above it.
    fits = view(usage(100 * MiB, 60 * MiB), calm)
    ok = diagnose(model_of([fits], [calm]))
    assert [(f.severity, f.area) for f in ok.findings] == [("ok", "shm"), ("ok", "memory")]
    over = view(usage(100 * MiB + 4096, 60 * MiB), calm)
    assert [(f.severity, f.subject) for f in diagnose(model_of([over], [calm])).findings][-1] == ("warn", "/dev/shm")
    unlimited = diagnose(model_of([], [cgroup(5 * MiB, None)]))
    assert unlimited.findings[0].severity == "info" and "no memory limit" in unlimited.findings[0].message


def test_host_memory_and_pods():
    low = HostMemory(100 * GiB, int(100 * GiB * T.HOST_MEMORY_AVAILABLE_LOW_RATIO) - MiB, 0)
    fine = HostMemory(100 * GiB, int(100 * GiB * T.HOST_MEMORY_AVAILABLE_LOW_RATIO), 0)
    assert diagnose(model_of([], [], low)).findings[0].severity == "warn"
    assert diagnose(model_of([], [], fine)).findings[0].severity == "ok"
    risky = cgroup(int(GiB * T.OOM_RISK_RATIO) + 1, GiB, "u1")
    calm = cgroup(int(GiB * T.OOM_RISK_RATIO), GiB, "u2")
    pods = diagnose(model_of([], [risky, calm], node_mode=True))
    assert [(f.severity, f.subject) for f in pods.findings] == [("warn", "pod u1")]
    assert [(f.severity, f.message) for f in diagnose(model_of([], [calm], node_mode=True)).findings] == [
        ("ok", "1 pod cgroup(s), none above 90% of its limit")]
    failed = diagnose(model_of([], [], statuses=[SourceStatus("sysv", False, 0.0, "EACCES")]))
    assert [(f.severity, f.area, f.subject) for f in failed.findings] == [("warn", "sysv", "collector sysv")]


def test_gpu_findings():
    """A GPU with less than 2 % free warns (the boundary is ok), a GPU NVML skipped warns with
    its reason, and NVML failing whole is said (info), not taken as no GPU."""
    full = 49 * GiB  # 98 % of 50 GiB exactly: the boundary is ok
    assert full / (50 * GiB) == T.GPU_MEMORY_FULL_RATIO
    gpus = GpuSnapshot("550.54", [
        GpuDevice("0", "GPU-a", "H100", 50 * GiB, full + 1, GiB - 1, None),
        GpuDevice("1", "GPU-b", "H100", 50 * GiB, full, GiB, 0),
        GpuDevice("2", "GPU-c", "broken", 0, 0, 0, None)],
        errors=["GPU 3: Unknown Error"])
    model = Model(False, [], [], None, [], None, [], gpus, [], None)
    report = diagnose(model)
    assert [(f.severity, f.area, f.subject, f.message, f.remedy) for f in report.findings] == [
        ("warn", "gpu", "GPU 0 H100", "49.0 GiB of 50.0 GiB used (98%): less than 2 % free",
         "lower --gpu-memory-utilization or stop the other GPU processes"),
        ("ok", "gpu", "GPU 1 H100", "49.0 GiB of 50.0 GiB used (98%)", ""),
        ("ok", "gpu", "GPU 2 broken", "0 B of 0 B used (0%)", ""),
        ("warn", "gpu", "NVML", "GPU skipped: GPU 3: Unknown Error", "nvidia-smi; dmesg | grep -i xid")]
    assert [g["uuid"] for g in report.facts["gpus"]] == ["GPU-a", "GPU-b", "GPU-c"]
    failed = Model(False, [SourceStatus("gpu", False, 0.0, "NVML: driver not loaded")], [], None, [], None, [],
                   None, [], None)
    [f] = diagnose(failed).findings
    assert (f.severity, f.area, f.subject, f.message) == ("info", "gpu", "NVML",
                                                        "GPU memory not checked: NVML: driver not loaded")
    assert diagnose(Model(False, [], [], None, [], None, [], None, [], None)).findings == []


# --- `shmwatch check`: the whole report ----------------------------------------------------------
def test_backend_and_failed_collectors():
    from exporter.model.step import OomCount
    u = usage(8 * GiB, 0)
    model = model_of([view(u)], [], statuses=[SourceStatus("gpu", False, 0.0, "no driver"),
                                              SourceStatus("host_memory", False, 0.0, "EIO"),
                                              SourceStatus("cgroup", False, 0.0, None),
                                              SourceStatus("shm_mount", True, 0.0, None)])
    r = diagnose(model, backend="vllm")
    found = [(f.severity, f.area, f.subject, f.message) for f in r.findings]
    assert ("info", "gpu", "NVML", "GPU memory not checked: no driver") in found
    assert ("warn", "memory", "collector host_memory", "could not be read: EIO") in found
    assert ("warn", "shm", "/dev/shm", "can hold 8.0 GiB, under the 16.0 GiB recommended for vllm") in found
    assert ("info", "memory", "cgroup", "not read: no answer within --timeout") in found
    assert not [f for f in found if f[2] in ("collector gpu", "collector cgroup")]  # said elsewhere
    assert [f.severity for f in diagnose(model, required=16 * GiB, backend="vllm").findings if f.area == "shm"] == [
        "fail"]  # the requirement says it: no second finding
    assert not [f for f in diagnose(model, backend="trtllm", required=80 * GiB).findings
                if "recommended for trtllm" in f.message]
    assert not [f for f in diagnose(model_of([view(usage(16 * GiB, 0))], []), backend="sglang").findings
                if "recommended" in f.message]
    cg = cgroup(10 * MiB, GiB)
    counted = model_of([], [cg])
    object.__setattr__(counted, "oom_kills", [OomCount("/c", "", 3)])
    kills = [(f.severity, f.message, f.remedy) for f in diagnose(counted).findings]
    assert ("warn", "3 OOM kill(s) so far", "count /dev/shm in the memory budget") in kills
    assert diagnose(model_of([], [CgroupMemory("/c", 1, 1, GiB, 1, None, 2, "cgroup")])).findings[-1].message == \
        "2 OOM kill(s) so far"


def test_memory_finding_texts():
    est = CgroupMemory("(estimate)", 0, 100 * MiB, 400 * MiB, 100 * MiB, 5 * MiB, None, "flag", estimated=True)
    [f] = diagnose(model_of([], [est])).findings
    assert (f.severity, f.subject, f.remedy) == ("ok", "(estimate)", "")
    assert f.message == ("working set 100.0 MiB of 400.0 MiB limit (25%) (estimated: the workload's resident "
                         "memory and shm; its cgroup is not readable here), shmem 5.0 MiB")
    high = cgroup(400 * MiB, 400 * MiB)
    [f] = diagnose(model_of([], [high])).findings
    assert (f.severity, f.remedy) == ("warn", "raise the memory limit or free shm")
    [f] = diagnose(model_of([], [cgroup(5 * MiB, None)])).findings
    assert f.message == "working set 5.0 MiB, no memory limit: OOM ratios not computed (pass --memory.limit-bytes)"
    host = HostMemory(10 * GiB, 5 * GiB, GiB)
    [f] = diagnose(model_of([], [], host)).findings
    assert (f.subject, f.message, f.remedy) == ("host", "5.0 GiB of 10.0 GiB available (50%), shmem 1.0 GiB", "")
    assert diagnose(model_of([], [], HostMemory(0, 0, 0))).findings[0].severity == "ok"
    low = diagnose(model_of([], [], HostMemory(10 * GiB, 0, 0))).findings[0]
    assert (low.severity, low.remedy) == ("warn", "free leaked shm, move workloads")
    # Another cgroup's mount, or one without a budget, is not this cgroup's projection.
    other = cgroup(300 * MiB, 400 * MiB)
    foreign = view(usage(GiB, 0), other)
    assert [f.area for f in diagnose(model_of([foreign], [cgroup(300 * MiB, 400 * MiB)])).findings] == [
        "shm", "memory"]
    nodes = model_of([view(usage(GiB, 0), other)], [other], host, node_mode=True)
    assert [(f.area, f.subject) for f in diagnose(nodes).findings] == [("shm", "/dev/shm"), ("memory", "pods"),
                                                                      ("memory", "host")]
    pod = cgroup(GiB, GiB, "u1")
    pods = model_of([], [pod], node_mode=True)
    object.__setattr__(pods, "oom_kills", [])
    found = diagnose(pods)
    assert [(f.severity, f.subject, f.message, f.remedy) for f in found.findings] == [
        ("warn", "pod u1", "working set 1.0 GiB of 1.0 GiB limit (100%)", "raise the pod's memory limit or free its shm")]
    assert found.facts["pod_cgroups"][0]["pod_uid"] == "u1"


def findings(report):
    return [(f.severity, f.area, f.subject, f.message, f.remedy) for f in report.findings]


def test_a_mount_report_word_for_word():
    """Every finding and fact of one mount, exactly: the wording is what users act on."""
    inv = inventory("/dev/shm", [
        *(seg(f"nccl-{i}", "nccl", "orphan", MiB, mtime=9_990.0 - i) for i in range(7)),
        seg("torch_h", "torch", "hidden", MiB, holders=(3,)), seg("lock", "other", "orphan", 4096, mtime=20_000.0),
        seg("plasma0", "ray", "linked", 0, holders=(3,)),
        *(seg(f"psm_u{i}", "python_shm", "unverified", MiB) for i in range(6))], unattributed_bytes=MiB)
    r = judge(usage(GiB, 17 * MiB), inventory=inv)
    rm = "/dev/shm/nccl-0 /dev/shm/nccl-1 /dev/shm/nccl-2 /dev/shm/nccl-3 /dev/shm/nccl-4"
    assert findings(r) == [
        ("ok", "shm", "/dev/shm", "1.0 GiB, 17.0 MiB used (2%); by class: nccl 7.0 MiB, python_shm 6.0 MiB, "
                                  "torch 1.0 MiB, other 4.0 KiB", ""),
        ("warn", "shm", "/dev/shm", f"7 leaked segment(s) held by no process, 7.0 MiB: {rm} (+2 more)",
         f"once no server can attach to them: rm -- {rm}"),  # a command to paste: the 5 named
        ("info", "shm", "/dev/shm", "1 file(s) of no known owner class held by no process, 4.0 KiB: /dev/shm/lock",
         "find which tool made them before removing anything (a container engine's lock file is one)"),
        ("info", "shm", "/dev/shm", "6 segment(s), 6.0 MiB, held by no process shmwatch could inspect (could not "
                                    "read 0 process(es)): not called leaked, they may be live",
         "to tell live from leaked, run shmwatch as the server's UID or with CAP_SYS_PTRACE (README: Deploy); "
         "never remove them on this report's word"),
        ("info", "shm", "/dev/shm", "1 unlinked-but-mapped segment(s), 1.0 MiB: counted by df, invisible to ls "
                                    "(NCCL >= 2.19, UCX proc link, torch file_descriptor)", ""),
    ]
    orphan = {"class": "nccl", "bytes": MiB}
    assert r.facts == {"shm": [{
        "mount": "/dev/shm", "fstype": "tmpfs", "size_bytes": GiB, "used_bytes": 17 * MiB,
        "available_bytes": GiB - 17 * MiB, "effective_size_bytes": GiB,
        "bytes_by_class": {"nccl": 7 * MiB, "torch": MiB, "other": 4096, "ray": 0, "python_shm": 6 * MiB},
        "orphans": [*({"name": f"nccl-{i}", **orphan, "age_seconds": 10 + i} for i in range(7)),
                    {"name": "lock", "class": "other", "bytes": 4096, "age_seconds": 0}],  # a future mtime: 0
        "unverified": [{"name": f"psm_u{i}", "class": "python_shm", "bytes": MiB} for i in range(6)],
        "hidden_bytes": MiB, "segments": 16, "unattributed_bytes": MiB}]}
    five = inventory("/m", [seg(f"torch_{i}", "torch", "orphan") for i in range(5)])
    [_, leaked] = findings(judge(usage(GiB, 0, "/m"), inventory=five))
    assert leaked[3].endswith("/m/torch_4") and "more" not in leaked[3]


def test_trouble_word_for_word():
    full = judge(usage(GiB, int(GiB * 0.96)), required=MiB, inventory=MountInventory("/dev/shm"))
    assert findings(full) == [("fail", "shm", "/dev/shm", "1.0 GiB, 983.0 MiB used (96%): about to be full",
                               "remove leaked segments (below) or raise the size")]
    assert full.facts["shm"][0]["bytes_by_class"] == {} and full.facts["shm"][0]["segments"] == 0
    broken = MountInventory("/dev/shm", error="EIO")
    assert findings(judge(usage(GiB, 0), inventory=broken)) == [("ok", "shm", "/dev/shm", "1.0 GiB, 0 B used (0%)", "")]
    assert "bytes_by_class" not in judge(usage(GiB, 0), inventory=broken).facts["shm"][0]
    error = Report()
    shm(error, view(MountUsage("/x", "tmpfs", "t", False, error="gone")), None, None)
    assert findings(error) == [("warn", "shm", "/x", "cannot be measured: gone",
                                "mount the workload's shm volume at this path")]
    assert "shm" not in error.facts
    other = Report()
    shm(other, view(MountUsage("/dev/shm", "ext4", "/dev/vda", True, size_bytes=GiB)), None, None)
    assert findings(other) == [("warn", "shm", "/dev/shm", "is ext4, not tmpfs", "mount a tmpfs (or memory emptyDir) here")]


def test_who_could_not_be_read():
    from exporter.check.report import _unreadable
    assert _unreadable(3, ["a (pid 1)", "b (pid 2)", "c (pid 3)"]) == "3 process(es): a (pid 1); b (pid 2); c (pid 3)"
    assert _unreadable(4, ["a (pid 1)"]) == "4 process(es): a (pid 1) and more"
    six = [f"p{i}" for i in range(6)]
    assert _unreadable(6, six) == "6 process(es): p0; p1; p2; p3; p4 and more"
    assert _unreadable(2, []) == "2 process(es)"
    assert _unreadable(None, ["hidepid=2: every other UID"]) == "hidepid=2: every other UID"
    assert _unreadable(None, []) == "processes hidden from shmwatch, uncounted"


def test_advice_word_for_word():
    assert shm_remedy(75 * MiB + 1) == ("docker run --shm-size=76m (or --ipc=host); compose shm_size: 76mb; Kubernetes: "
                                        "an emptyDir {medium: Memory, sizeLimit: 76Mi} mounted at /dev/shm")
    assert shm_remedy(GiB + 1) == ("docker run --shm-size=2g (or --ipc=host); compose shm_size: 2gb; Kubernetes: an "
                                   "emptyDir {medium: Memory, sizeLimit: 2Gi} mounted at /dev/shm")
    assert settings_for(75 * MiB, "dshm", 405 * MiB) == {
        "docker_run": "docker run --shm-size=75m",
        "compose": "shm_size: 75m",
        "kubernetes_volume": "volumes: [{name: dshm, emptyDir: {medium: Memory, sizeLimit: 75Mi}}]",
        "kubectl_patch": "kubectl patch deployment <name> --type=strategic -p "
                         """'{"spec":{"template":{"spec":{"volumes":[{"name":"dshm","emptyDir":"""
                         """{"medium":"Memory","sizeLimit":"75Mi"}}]}}}}'""",
        "docker_run_memory": "docker run --memory=405m",
        "compose_memory": "mem_limit: 405m",
        "kubernetes_memory_limit": "kubectl set resources deployment <name> -c <container> --limits=memory=405Mi",
    }


def test_memory_report_word_for_word():
    from dataclasses import asdict

    from exporter.model.step import OomCount
    host = HostMemory(0, 0, 0)
    cg = cgroup(300 * MiB, 400 * MiB)
    other = cgroup(10 * MiB, 400 * MiB)
    mounts = [view(usage(GiB, 0, "/other"), other), view(usage(GiB, 0, "/dev/shm"), cg)]
    model = model_of(mounts, [cg], host)
    object.__setattr__(model, "oom_kills", [OomCount("/c", "", 2)])
    r = diagnose(model)
    assert [f for f in findings(r) if f[1] == "memory"] == [
        ("ok", "memory", "host", "0 B of 0 B available (100%), shmem 0 B", ""),
        ("ok", "memory", "/c", "working set 300.0 MiB of 400.0 MiB limit (75%)", ""),
        ("warn", "memory", "/c", "2 OOM kill(s) so far", "count /dev/shm in the memory budget"),
        ("warn", "memory", "/dev/shm", "filling it (1.0 GiB) would need 331% of the memory limit: the pod is "
                                       "OOM-killed before tmpfs says ENOSPC",
         "lower sizeLimit to at most 100.0 MiB or raise the memory limit")]
    assert r.facts["host_memory"] == asdict(host) and r.facts["cgroup"] == asdict(cg)
    unlimited = diagnose(model_of([], [cgroup(5 * MiB, None)]))
    assert findings(unlimited) == [("info", "memory", "/c", "working set 5.0 MiB, no memory limit: OOM ratios not "
                                                             "computed (pass --memory.limit-bytes)", "")]
    # Pods: at the threshold is not above it; no limit is no ratio; kills are the pod's.
    pods = [CgroupMemory("/p1", 1, 0, 1000 * MiB, 900 * MiB, None, 0, "cgroup", "u1"),
            CgroupMemory("/p2", 1, 0, None, 900 * MiB, None, 0, "cgroup", "u2")]
    calm = model_of([], pods, node_mode=True)
    assert findings(diagnose(calm)) == [("ok", "memory", "pods", "2 pod cgroup(s), none above 90% of its limit", "")]
    object.__setattr__(calm, "oom_kills", [OomCount("/p2", "u2", 4)])
    assert findings(diagnose(calm)) == [
        ("warn", "memory", "pod u2", "4 OOM kill(s) so far", "count /dev/shm in the memory budget"),
        ("ok", "memory", "pods", "2 pod cgroup(s), none above 90% of its limit", "")]
    risky = model_of([], [CgroupMemory("/p3", 1, 0, 1000 * MiB, 901 * MiB, None, 0, "cgroup", "u3")], node_mode=True)
    assert findings(diagnose(risky)) == [("warn", "memory", "pod u3", "working set 901.0 MiB of 1000.0 MiB limit (90%)",
                                          "raise the pod's memory limit or free its shm")]
    # The kernel log, a failed collector of no area of its own, a backend with no mount.
    failed = model_of([], [], statuses=[SourceStatus("oom", False, 0.0, "EPERM"),
                                        SourceStatus("segments", False, 0.0, "boom")])
    assert findings(diagnose(failed, backend="vllm")) == [
        ("info", "memory", "OOM kills", "kernel log not read: EPERM", ""),
        ("warn", "shm", "collector segments", "could not be read: boom", "")]
    backend = diagnose(model_of([view(usage(8 * GiB, 0))], []), backend="vllm")
    assert findings(backend)[-1][4] == shm_remedy(16 * GiB)
    # A mount with segments through the whole report: its orphans' ages from the inventory's time.
    inv = inventory("/dev/shm", [seg("nccl-x", "nccl", "orphan", MiB, mtime=9_000.0)])
    full = model_of([MountView("/dev/shm", {}, usage(GiB, MiB), None, None, None, inv, summarise(inv, 5), None,
                               shm_budget(usage(GiB, MiB), None))], [])
    object.__setattr__(full, "inventory", Inventory([inv], {}, 0, 1, wall_time=10_000.0))
    assert diagnose(full).facts["shm"][0]["orphans"][0]["age_seconds"] == 1000


def test_names_past_the_fifth():
    from exporter.check.report import _unreadable
    six = inventory("/m", [seg(f"torch_{i}", "torch", "orphan") for i in range(6)])
    [_, leaked] = findings(judge(usage(GiB, 0, "/m"), inventory=six))
    assert leaked[3].endswith("/m/torch_4 (+1 more)")
    assert _unreadable(5, [f"p{i}" for i in range(5)]) == "5 process(es): p0; p1; p2; p3; p4"


def test_an_empty_inventory_is_a_plain_ok():
    assert findings(judge(usage(GiB, 0), inventory=MountInventory("/dev/shm"))) == [
        ("ok", "shm", "/dev/shm", "1.0 GiB, 0 B used (0%)", "")]
