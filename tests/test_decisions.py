"""Exact cases for the decisions that matter most, each with values that tell the right answer
from its near miss: the segment summary (oldest orphan, leaks), the budget behind the OOM
projection, `check`'s thresholds and advice, the recommendation, web-config authorisation.
Pure and fast: part of the mutation-testing selection (pyproject.toml [tool.mutmut])."""
import base64
from types import SimpleNamespace

import bcrypt
import pytest

from exporter.check import thresholds as T
from exporter.check.findings import Report
from exporter.check.recommend import (SourcePeak, memory_limit_needed, parse_headroom, peaks_from_exporter, parse_window, recommend,
                                      recommendations, settings_for)
from exporter.check.report import diagnose
from exporter.check.report import shm, shm_remedy
from exporter.inventory.holdings import unheld_state
from exporter.exposition.webconfig import WebConfig, WebConfigSource
from exporter.model.summary import shm_budget
from exporter.model.step import Model, MountView, SourceStatus
from exporter.model.summary import owner_comm, summarise
from exporter.model.types import (CgroupMemory, ClassTotals, GpuDevice, GpuSnapshot, HostMemory, Inventory,
                                  MountInventory, MountUsage, Row, Segment)

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


# --- segment states (DESIGN.md "Segment states") -----------------------------------------------
def test_segment_states():
    """(known at the last full scan, held at it, every process inspected, quick run, owners
    from a full scan this run) -> the state of a listed file nobody holds (a held one is
    linked without asking). Leaked only on a full scan's word."""
    dev, ino = 40, 7
    cases = {
        (True, False, True, False, True): "orphan",  # known, unheld, a full scan saw it
        (True, False, False, False, True): "unverified",  # somebody could not be inspected
        (True, True, True, False, False): "unverified",  # held at the full scan: only it may say
        (True, True, True, True, False): "unverified",
        (True, False, True, True, False): "orphan",  # a quick run: the full scan's owners hold
        (True, True, True, False, True): "orphan",  # the full scan itself found it unheld
        (False, False, True, True, False): "linked",  # new since the full scan: its creator's
        (False, False, False, True, False): "linked",
        (False, False, True, False, True): "orphan",  # new, and the full scan found nobody
        (False, False, False, False, True): "unverified",
        (False, False, True, False, False): "unverified",  # a refresh found nobody: not leaked yet
        (False, True, True, False, False): "unverified",
    }
    for (known, at_full, complete, quick, settled), state in cases.items():
        row = Row.pack(class_index=0, inode=ino, mtime=0, blocks=8, apparent_bytes=4096, known=known)
        held_at_full = {(dev, ino)} if at_full else set()
        got = unheld_state("a", row, (dev, ino), dev, (), held_at_full, complete, quick, settled)
        assert got == state, (known, at_full, complete, quick, settled)


# --- the segment summary --------------------------------------------------------------------
def seg(name, cls, state, size=MiB, mtime=0.0, holders=()):
    return Segment(name, cls, state, size, size + 1, mtime, holders)


def inventory(mount, segments, **fields):
    """A MountInventory holding `segments`, packed as the collector keeps them."""
    from exporter.model.types import CLASS_NAMES, STATES
    listed, states, hidden, held = {}, bytearray(), [], {}
    for ino, s in enumerate(segments, 1):
        if s.state == "hidden":
            hidden.append(s)
            continue
        listed[s.name] = Row.pack(class_index=CLASS_NAMES.index(s.cls), inode=ino, mtime=s.mtime,
                                  blocks=s.allocated_bytes // 512, apparent_bytes=s.apparent_bytes)
        states.append(STATES.index(s.state))
        if s.holders:
            held[ino] = s.holders
    return MountInventory(mount, names=tuple(listed), packed=tuple(listed.values()), states=bytes(states),
                          hidden=tuple(hidden), held=held, **fields)


def test_the_oldest_orphan_is_the_oldest_removable_one():
    """Two removable orphans of different ages: the older one's mtime, not the newer's. Older
    segments that are not removable orphans (a semaphore, a linked or unverified one) do not count."""
    inv = inventory("/dev/shm", [
        seg("nccl-new", "nccl", "orphan", mtime=5000.0),
        seg("torch_1_old", "torch", "orphan", mtime=1000.0),
        seg("sem.x", "semaphore", "orphan", mtime=10.0),
        seg("other-file", "other", "orphan", mtime=20.0),
        seg("nccl-live", "nccl", "linked", mtime=1.0, holders=(7,)),
        seg("psm_unknown", "python_shm", "unverified", mtime=2.0),
    ])
    assert summarise(inv, 3).oldest_orphan_mtime == 1000.0
    assert summarise(inventory("/m", [seg("sem.y", "semaphore", "orphan", mtime=3.0)]),
                     3).oldest_orphan_mtime is None


def test_summary_totals_leaks_and_top():
    inv = inventory("/dev/shm", [
        seg("nccl-a", "nccl", "linked", 4 * MiB, holders=(9, 3)),
        seg("nccl-b", "nccl", "linked", 2 * MiB, holders=(3,)),
        seg("nccl-c", "nccl", "orphan", 3 * MiB),
        seg("psm_d", "python_shm", "orphan", 5 * MiB),
        seg("sem.e", "semaphore", "orphan", 4096),
        seg("torch_f", "torch", "hidden", 6 * MiB, holders=(4,)),
        seg("torch_g", "torch", "hidden", 1 * MiB, holders=(4,)),
        seg("psm_h", "python_shm", "unverified", 1 * MiB),
        seg("sem.i", "semaphore", "unverified", 4096),
        seg("psm_j", "python_shm", "unverified", 2 * MiB),
    ], process_bytes={9: 4 * MiB, 5: 6 * MiB, 4: 7 * MiB, 3: 6 * MiB})
    s = summarise(inv, 2)
    assert s.totals[("nccl", "linked")] == ClassTotals(count=2, allocated_bytes=6 * MiB, apparent_bytes=6 * MiB + 2)
    assert s.totals[("nccl", "orphan")] == ClassTotals(count=1, allocated_bytes=3 * MiB, apparent_bytes=3 * MiB + 1)
    assert s.bytes_by_class == {"nccl": 9 * MiB, "python_shm": 8 * MiB, "semaphore": 8192, "torch": 7 * MiB}
    assert (s.hidden_bytes, s.hidden_count) == (7 * MiB, 2)
    assert [x.name for x in s.top] == ["psm_d", "nccl-c"]  # leaks first (not the semaphore)
    assert s.top_processes == [(4, 7 * MiB), (3, 6 * MiB)]  # a tie goes to the lower pid
    assert [x.name for x in s.leaked] == ["psm_d", "nccl-c"]  # largest first, no semaphore
    assert [x.name for x in s.unverified] == ["psm_j", "psm_h"]  # largest first, no semaphore
    assert s.named_pids == {4, 3}
    assert [x.name for x in summarise(inv, 3).top] == ["psm_d", "nccl-c", "torch_f"]
    tie = inventory("/m", [seg("b", "other", "linked"), seg("a", "other", "linked")])
    assert [x.name for x in summarise(tie, 1).top] == ["a"]


def test_owner_comm():
    assert owner_comm([], {}) == ""
    assert owner_comm([12], {12: "python"}) == "python"
    assert owner_comm([12, 13], {}) == "unknown"
    assert owner_comm([12, 13, 14, 15], {12: "vllm"}) == "vllm"


# --- the budget behind the OOM projection ---------------------------------------------------
def usage(size, used, mount="/dev/shm"):
    return MountUsage(mount, "tmpfs", "tmpfs", True, size_bytes=size, used_bytes=used,
                      available_bytes=size - used)


def cgroup(working_set, limit, pod_uid=""):
    return CgroupMemory("/c", 1, working_set, limit, working_set, None, 0, "cgroup", pod_uid)


def test_shm_budget_exact():
    b = shm_budget(usage(2 * GiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB))
    # 330 MiB used outside shm: 70 MiB of room, and a full 2 GiB mount would need 2378/400 of it.
    assert (b.fillable_bytes, b.effective_bytes, b.room_bytes) == (2 * GiB, 70 * MiB, 70 * MiB)
    assert b.projection == (330 * MiB + 2 * GiB) / (400 * MiB)
    b = shm_budget(usage(2 * GiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB), size_limit=50 * MiB)
    assert (b.fillable_bytes, b.effective_bytes) == (50 * MiB, 50 * MiB)
    assert b.projection == 380 / 400
    b = shm_budget(usage(2 * GiB, 0), None, memory_limit=512 * MiB)
    assert (b.fillable_bytes, b.effective_bytes, b.projection, b.room_bytes) == (2 * GiB, 512 * MiB, None,
                                                                                  512 * MiB)
    b = shm_budget(usage(2 * GiB, 0), cgroup(10, None), memory_limit=512 * MiB)  # unlimited cgroup
    assert (b.effective_bytes, b.projection, b.room_bytes) == (2 * GiB, None, None)
    assert shm_budget(usage(64 * MiB, 0), cgroup(0, 8 * GiB)).effective_bytes == 64 * MiB


# --- the recommendation -----------------------------------------------------------------------
def view(u, cg=None, labels=None, max_used=None, budget_memory=None):
    return MountView(u.mount, labels or {}, u, None, max_used, None, None, None, cg,
                     shm_budget(u, cg, memory_limit=budget_memory))


def test_the_memory_limit_needed_counts_what_is_not_shm():
    """Working set 390 MiB of which 60 MiB is shm, limit 400 MiB: a 75 MiB mount needs 330 +
    75 = 405 MiB of limit, which does not fit (with working set and shm swapped: 75, fits)."""
    assert memory_limit_needed(75 * MiB, 390 * MiB, 60 * MiB) == 405 * MiB
    assert memory_limit_needed(75 * MiB, 10 * MiB, 60 * MiB) == 75 * MiB  # less than shm: clamped
    assert memory_limit_needed(75 * MiB, 390 * MiB, 60 * MiB - 1) == 406 * MiB  # rounded up to MiB
    r = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB)), 60 * MiB, "current", None, 1.25)
    assert (r.recommended_size_bytes, r.memory_limit_bytes, r.memory_limit_bytes_needed) == (
        75 * MiB, 400 * MiB, 405 * MiB)
    assert r.memory_limit_fits is False and r.observed_peak_bytes == 60 * MiB and r.notes == []
    doubled = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 400 * MiB)), 60 * MiB, "current", None, 2.0)
    assert (doubled.recommended_size_bytes, doubled.memory_limit_bytes_needed) == (120 * MiB, 450 * MiB)
    assert r.settings["docker_run_memory"] == "docker run --memory=405m"
    assert r.settings["kubernetes_volume"].endswith("{name: dshm, emptyDir: {medium: Memory, sizeLimit: 75Mi}}]")
    fits = recommend(view(usage(256 * MiB, 60 * MiB), cgroup(390 * MiB, 405 * MiB), {"volume": "cache"}),
                     60 * MiB, "exporter", None, 1.25, "a note")
    assert fits.memory_limit_fits is True and "docker_run_memory" not in fits.settings
    assert "name: cache," in fits.settings["kubernetes_volume"] and fits.notes == ["a note"]
    unlimited = recommend(view(usage(256 * MiB, 0), cgroup(10 * MiB, None)), -5, "current", None, 1.25)
    assert unlimited.memory_limit_fits is None and unlimited.observed_peak_bytes == 0
    assert unlimited.memory_limit_bytes_needed == 1 * MiB + 10 * MiB  # the 1 MiB floor of a size
    none = recommend(view(usage(256 * MiB, 0)), 3 * GiB, "prometheus", "7d", 1.25)
    assert none.memory_limit_bytes is None and none.memory_limit_fits is None and none.window == "7d"
    assert none.recommended_size_bytes == 4 * GiB and none.current_size_bytes == 256 * MiB


def test_recommended_size_and_settings():
    def size(peak, headroom=1.25):
        return recommend(view(usage(256 * MiB, 0)), peak, "current", None, headroom).recommended_size_bytes

    assert size(60 * MiB) == 75 * MiB
    assert size(60 * MiB, 2.0) == 120 * MiB
    assert size(900 * MiB) == 2 * GiB  # 1125 MiB: whole GiB above 1 GiB
    s = settings_for(75 * MiB, "dshm", None)
    assert s["docker_run"] == "docker run --shm-size=75m" and s["compose"] == "shm_size: 75m"
    assert '"sizeLimit":"75Mi"' in s["kubectl_patch"] and set(s) == {
        "docker_run", "compose", "kubernetes_volume", "kubectl_patch"}
    m = settings_for(2 * GiB, "v", 3 * GiB)
    assert m["compose_memory"] == "mem_limit: 3g" and m["kubernetes_memory_limit"].endswith("--limits=memory=3Gi")


def test_recommendations_take_the_higher_current_use():
    extra = SimpleNamespace(prometheus_selector="", recommend_window="7d", prometheus_url=None,
                            exporter_url=None, recommend_headroom=1.25, require_shm=None)
    views = [view(usage(256 * MiB, 40 * MiB, "/a"), max_used=80 * MiB), view(usage(256 * MiB, 8 * MiB, "/b")),
             MountView("/c", {}, None, None, None, None, None, None, None, None)]
    recs, notes = recommendations(SimpleNamespace(mounts=views), extra)
    assert [(r.mount, r.observed_peak_bytes, r.source) for r in recs] == [("/a", 40 * MiB, "current"),
                                                                           ("/b", 8 * MiB, "current")]
    assert notes == [] and recs[0].recommended_size_bytes == 50 * MiB


def test_recommend_flags():
    assert parse_window("7d") == "7d" and parse_window("1h30m") == "1h30m"
    for bad in ("7", "a week", "7d "):
        with pytest.raises(ValueError, match=r"^not a Prometheus duration: '.*' \(e.g. 7d, 36h\)$"):
            parse_window(bad)
    assert parse_headroom("1") == 1.0 and parse_headroom("10") == 10.0
    for bad in ("0.99", "10.5"):
        with pytest.raises(ValueError, match="^must be between 1 and 10$"):
            parse_headroom(bad)


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


# --- web-config authorisation -----------------------------------------------------------------
def basic(user, password):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


PEERS = iter(range(1 << 30))


class Source(WebConfigSource):
    """authorize(), waited on when bcrypt runs, from a peer of its own each time."""

    def authorized(self, config, header):
        answer = self.authorize(config, header, f"peer{next(PEERS)}")
        return answer if isinstance(answer, bool) else answer.result(30)


def test_an_unknown_user_is_refused_whatever_the_password():
    """Unknown users are checked against a dummy hash (cost 10, as exporter-toolkit's), whose
    password is 'no such user': a match there must still be a refusal."""
    alice = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4))
    source = Source(fixed=WebConfig(users={"alice": alice}))
    config = source.config
    assert not source.authorized(config, basic("mallory", "no such user"))
    assert not source.authorized(config, basic("mallory", "wonderland"))
    assert not source.authorized(config, basic("alice", "no such user"))
    assert source.authorized(config, basic("alice", "wonderland"))
    assert source.authorized(config, "bAsIc " + basic("alice", "wonderland")[6:])  # the scheme is any case
    for header in (None, "", "Bearer x", "Basic !!", "Basic " + base64.b64encode(b"alice").decode(),
                   "Basic " + base64.b64encode(b"\xff:x").decode()):
        assert not source.authorized(config, header), header
    assert Source(fixed=WebConfig()).authorized(WebConfig(), None)  # no users: open


# --- where the peak comes from: Prometheus, a running exporter, this run ------------------------
class Peers:
    """A Prometheus query API and an exporter's /metrics on loopback, answering from tables."""

    def __init__(self, prometheus, exporter, status="success"):
        import http.server
        import json
        import threading
        import urllib.parse

        peers = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                url = urllib.parse.urlparse(self.path)
                if url.path == "/api/v1/query":
                    query = urllib.parse.parse_qs(url.query)["query"][0]
                    peers.queries.append(query)
                    result = [{"metric": {}, "value": [0, str(v)]}
                              for mount, values in prometheus.items() if f'mount="{mount}"' in query
                              for v in values]
                    body = json.dumps({"status": status, "error": "bad query", "data": {"resultType": "vector", "result": result}})
                else:
                    body = "".join(f'shmwatch_mount_max_used_bytes{{mount="{m}"}} {v}\n' for m, v in exporter.items())
                self.send_response(200)
                self.end_headers()
                self.wfile.write(body.encode())

            def log_message(self, *args):
                pass

        self.queries = []
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def soon():
    import time
    return time.monotonic() + 30  # `shmwatch check --timeout`'s deadline


def extra(prometheus=None, exporter=None, selector=""):
    return SimpleNamespace(prometheus_selector=selector, recommend_window="7d", prometheus_url=prometheus,
                           exporter_url=exporter, recommend_headroom=1.25, require_shm=None)


def test_the_peak_comes_from_the_best_source_that_has_it():
    prom = Peers({"/a": [100 * MiB], "/b": [20 * MiB, 24 * MiB], "/d": [10 * MiB], "/e": [0]},
                 {"/b": 30 * MiB, "/c": 16 * MiB})
    try:
        views = [view(usage(GiB, 1 * MiB, m), max_used=mu) for m, mu in
                 (("/a", 2 * MiB), ("/b", None), ("/c", 3 * MiB), ("/d", 12 * MiB), ("/e", 0), ("/f", None))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(prom.url, prom.url + "/metrics"), soon())
        got = {r.mount: (r.source, r.window, r.observed_peak_bytes, r.notes) for r in recs}
        assert got["/a"] == ("prometheus", "7d", 100 * MiB, [])
        # Two series and no selector: another pod's /dev/shm may be one; the exporter's instead.
        assert got["/b"] == ("exporter", None, 30 * MiB, [])
        assert notes == ["Prometheus not used for /b: 2 series match; name this workload's with "
                         "--prometheus.selector"]
        assert got["/c"] == ("exporter", None, 16 * MiB, [])
        assert got["/d"] == ("current", None, 12 * MiB,
                             ["the current use is above what prometheus recorded: it is the peak"])
        assert got["/e"] == ("prometheus", "7d", 0, [])  # a peak of 0 is a peak
        assert got["/f"][0] == "current" and got["/f"][3] == [
            "no recorded peak: this is the current use only, a spike that is over is not seen"]
        assert prom.queries[0] == 'max_over_time(shmwatch_mount_peak_used_bytes{mount="/a"}[7d])'
        recs, notes = recommendations(SimpleNamespace(mounts=views[1:2]),
                                      extra(prom.url + "/", None, '{instance="x"}'), soon())
        assert prom.queries[-1] == 'max_over_time(shmwatch_mount_peak_used_bytes{mount="/b", instance="x"}[7d])'
        assert (recs[0].source, recs[0].observed_peak_bytes, notes) == ("prometheus", 24 * MiB, [])
        assert recs[0].notes == ["2 series matched this mount; the highest was taken (narrow them with "
                                 "--prometheus.selector)"]
    finally:
        prom.close()


def test_require_shm_raises_every_recommendation():
    """--require-shm is a floor wherever the peak comes from: a recorded peak, the current use
    alone, or the current use above what was recorded."""
    prom = Peers({"/a": [100 * MiB], "/d": [10 * MiB]}, {})
    try:
        views = [view(usage(GiB, 1 * MiB, m), max_used=mu) for m, mu in
                 (("/a", 2 * MiB), ("/d", 12 * MiB), ("/f", None))]
        wanted = extra(prom.url)
        wanted.require_shm = 2 * GiB
        recs, _ = recommendations(SimpleNamespace(mounts=views), wanted, soon())
        got = {r.mount: (r.source, r.observed_peak_bytes, r.recommended_size_bytes) for r in recs}
        assert got == {"/a": ("prometheus", 100 * MiB, 2 * GiB), "/d": ("current", 12 * MiB, 2 * GiB),
                       "/f": ("current", 1 * MiB, 2 * GiB)}
    finally:
        prom.close()


def test_a_source_that_fails_is_named_and_skipped():
    broken = Peers({"/a": [5 * MiB]}, {}, status="error")
    try:
        views = [view(usage(GiB, 2 * MiB, "/a"))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(broken.url, broken.url + "/metrics"), soon())
        assert [(r.source, r.observed_peak_bytes) for r in recs] == [("current", 2 * MiB)]
        assert notes[0].startswith(f"Prometheus not used: {broken.url}/api/v1/query?query=max_over_time")
        assert notes[0].endswith(": the query failed: bad query")
        assert notes[1] == (f"exporter not used: {broken.url}/metrics: no shmwatch_mount_max_used_bytes (an older "
                            "shmwatch?)")
    finally:
        broken.close()
    recs, notes = recommendations(SimpleNamespace(mounts=views), extra("http://127.0.0.1:9"), soon())
    assert notes[0].startswith("Prometheus not used: http://127.0.0.1:9/api/v1/query?query=max_over_time")


def test_without_a_deadline_the_sources_are_asked_and_awaited():
    """No deadline (math.inf, the default): an infinite socket or lock timeout overflows (it
    raised OverflowError out of recommendations(), and made each source a note)."""
    prom = Peers({"/a": [100 * MiB]}, {"/a": 40 * MiB})
    try:
        views = [view(usage(GiB, 1 * MiB, "/a"))]
        recs, notes = recommendations(SimpleNamespace(mounts=views), extra(prom.url, prom.url + "/metrics"))
        assert [(r.source, r.observed_peak_bytes) for r in recs] == [("prometheus", 100 * MiB)], notes
        assert notes == []
        assert peaks_from_exporter(prom.url + "/metrics") == {"/a": SourcePeak(peak_bytes=40 * MiB, series=1)}
    finally:
        prom.close()


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


def test_mount_labels_of_each_runtime():
    from exporter.host.kube import mount_labels
    uid, cid = "0f1e2d3c-aaaa-bbbb-cccc-001122334455", "ab" * 32
    assert mount_labels(f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~empty-dir/dshm") == {
        "pod_uid": uid, "volume": "dshm", "container_id": ""}
    for path in (f"/run/containerd/io.containerd.grpc.v1.cri/sandboxes/{cid}/shm",
                 f"/var/lib/containers/storage/overlay-containers/{cid}/userdata/shm",
                 f"/var/lib/docker/containers/{cid}/mounts/shm"):
        assert mount_labels(path) == {"pod_uid": "", "volume": "", "container_id": cid}, path
    assert mount_labels("/dev/shm") is None
    assert mount_labels(f"/var/lib/docker/containers/{cid}/mounts/shm/sub") is None


# --- sizes: a reading rounds to the nearest tenth, advice rounds the safe way --------------------
def test_sizes_exact():
    from exporter.check.findings import at_least, at_most, human, quantities, round_up
    assert [human(n) for n in (0, 12, 1023, KiB, 1536 * KiB, GiB - 1, 3 * GiB // 2, -2 * MiB)] == [
        "0 B", "12 B", "1023 B", "1.0 KiB", "1.5 MiB", "1024.0 MiB", "1.5 GiB", "-2.0 MiB"]
    assert at_least(GiB + 1) == "1.1 GiB" and at_most(GiB + 1) == "1.0 GiB"
    assert at_least(MiB * 15 // 10 + 1) == "1.6 MiB" and at_most(MiB * 19 // 10) == "1.8 MiB"
    assert at_least(1023.5) == "1024 B" and at_most(1023.5) == "1023 B" and at_least(KiB) == "1.0 KiB"
    assert at_least(16_000_000_000) == "15.0 GiB" and at_most(16_000_000_000) == "14.9 GiB"
    assert [round_up(n) for n in (0, 1, MiB, MiB + 1, GiB - 1, GiB, GiB + 1, 1.5)] == [
        MiB, MiB, MiB, 2 * MiB, GiB, GiB, 2 * GiB, MiB]
    sizes = (GiB, 2 * GiB, 3 * GiB, GiB + MiB, 75 * MiB, 75 * MiB + 1, 512 * MiB, 512 * MiB - 1)
    assert [quantities(n) for n in sizes] == [("1g", "1Gi"), ("2g", "2Gi"), ("3g", "3Gi"), ("1025m", "1025Mi"),
                                              ("75m", "75Mi"), ("76m", "76Mi"), ("512m", "512Mi"), ("512m", "512Mi")]



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


def test_authorisation_edges():
    users = {"alice": bcrypt.hashpw(b"won:der", bcrypt.gensalt(4))}
    source = Source(fixed=WebConfig(users=users))
    config = source.config
    assert source.authorized(config, basic("alice", "won:der"))  # the password may hold a colon
    mangled = basic("alice", "won:der")
    assert not source.authorized(config, mangled[:10] + "!" + mangled[10:])  # not strictly base64


def test_an_empty_inventory_is_a_plain_ok():
    assert findings(judge(usage(GiB, 0), inventory=MountInventory("/dev/shm"))) == [
        ("ok", "shm", "/dev/shm", "1.0 GiB, 0 B used (0%)", "")]


def test_bcrypt_checks_are_bounded_and_remembered():
    import time
    cheap, dear = bcrypt.hashpw(b"a", bcrypt.gensalt(4)), bcrypt.hashpw(b"b", bcrypt.gensalt(5))
    source = Source(fixed=WebConfig(users={"cheap": cheap, "dear": dear}))
    config = source.config
    assert source.authorized(config, basic("cheap", "a"))  # its own hash only, not padded to 5
    assert source.authorized(config, basic("dear", "b"))
    deadline = time.monotonic() + 20
    while source._checking and time.monotonic() < deadline:  # each check leaves the queue when done
        time.sleep(0.01)
    assert source._checking == set()
    # One check at a time per address, and at most BCRYPT_QUEUE waiting: beyond, refused at once.
    from exporter.exposition.webconfig import BCRYPT_QUEUE
    source._checking.add("10.0.0.9")
    assert source.authorize(config, basic("cheap", "wrong"), "10.0.0.9") is None  # busy: 503
    source._checking.update(f"10.0.1.{i}" for i in range(BCRYPT_QUEUE - 1))
    assert source.authorize(config, basic("cheap", "wrong"), "10.0.2.1") is None
    source._checking.clear()
    # Successes are remembered, within a bound.
    source._good = {bytes([i % 256, i // 256]): None for i in range(1024)}
    fresh = Source(fixed=WebConfig(users={"cheap": cheap}))
    fresh._good = dict(source._good)
    assert fresh.authorized(fresh.config, basic("cheap", "a")) and len(fresh._good) == 1
    assert fresh.authorize(fresh.config, basic("cheap", "a"), "any") is True  # from memory, no bcrypt
