#!/usr/bin/env python3
"""Write grafana/shmwatch.json, the shmwatch dashboard, from the panel list below.

    python3 grafana/make_dashboard.py

Kept as code so that panels stay consistent (units, datasource variable, selectors);
tests/test_dashboard.py checks the JSON against the metric catalogue and runs every
query against a live Prometheus.
"""
import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shmwatch.json")
DS = {"type": "prometheus", "uid": "${datasource}"}
# Every query carries these; namespace/pod match series without those labels too (".*").
S = 'job=~"$job", instance=~"$instance", namespace=~"$namespace", pod=~"$pod"'
SM = S + ', mount=~"$mount"'


# Instant-query tables: hide the bookkeeping columns, call the value what it is.
BYTES_TABLE = [{"id": "organize", "options": {"excludeByName": {"Time": True, "__name__": True, "job": True},
                                              "renameByName": {"Value": "bytes"}}}]


class Layout:
    def __init__(self):
        self.panels, self.next_id, self.y, self.x, self.row_h = [], 1, 0, 0, 0

    def row(self, title):
        self._newline()
        self.panels.append({"type": "row", "title": title, "id": self._id(), "collapsed": False,
                            "gridPos": {"h": 1, "w": 24, "x": 0, "y": self.y}, "panels": []})
        self.y += 1

    def panel(self, kind, title, description, targets, w=8, h=8, unit=None, thresholds=None, stack=False,
              minmax=None, overrides=None, transformations=None, options=None):
        if self.x + w > 24:
            self._newline()
        defaults = {}
        if unit:
            defaults["unit"] = unit
        if thresholds:
            defaults["thresholds"] = {"mode": "absolute", "steps": [{"color": "green", "value": None}] + [
                {"color": color, "value": value} for value, color in thresholds]}
            defaults["color"] = {"mode": "thresholds"}
        if minmax:
            defaults["min"], defaults["max"] = minmax
        if kind == "timeseries":
            defaults["custom"] = {"fillOpacity": 30 if stack else 10, "lineWidth": 1,
                                  "stacking": {"mode": "normal" if stack else "none", "group": "A"}}
        panel = {
            "type": kind, "title": title, "description": description, "id": self._id(), "datasource": DS,
            "gridPos": {"h": h, "w": w, "x": self.x, "y": self.y},
            "fieldConfig": {"defaults": defaults, "overrides": overrides or []},
            "targets": [dict(t, datasource=DS, refId=chr(ord("A") + i)) for i, t in enumerate(targets)],
        }
        if transformations:
            panel["transformations"] = transformations
        if options:
            panel["options"] = options
        self.panels.append(panel)
        self.x += w
        self.row_h = max(self.row_h, h)

    def _newline(self):
        self.y += self.row_h
        self.x, self.row_h = 0, 0

    def _id(self):
        self.next_id += 1
        return self.next_id - 1


def q(expr, legend="", instant=False, table=False):
    target = {"expr": expr, "legendFormat": legend or "__auto"}
    if instant:
        target["instant"], target["range"] = True, False
    if table:
        target["format"] = "table"
    return target


def build():
    d = Layout()
    d.row("Overview: is anything about to fail?")
    d.panel("gauge", "/dev/shm usage",
            "Used / size of each watched tmpfs. Red (95 %): the next NCCL/UCX/vLLM segment fails with ENOSPC or "
            "SIGBUS. Look at the Segments row for who holds it; clean leaked segments or raise --shm-size / "
            "shm_size / the emptyDir sizeLimit.",
            [q(f"max by (mount) (shmwatch_mount_usage_ratio{{{SM}}})", "{{mount}}", instant=True)],
            w=6, unit="percentunit", thresholds=[(0.8, "orange"), (0.95, "red")], minmax=(0, 1))
    d.panel("stat", "OOM risk (working set / limit)",
            "Working set of the watched memory cgroup over its limit; tmpfs pages count in it. Red (90 %): the OOM "
            "killer is close. Empty when there is no limit.",
            [q(f"max by (cgroup) (shmwatch_oom_risk_ratio{{{S}}})", "risk", instant=True),
             q(f"max by (mount) (shmwatch_shm_oom_projection_ratio{{{SM}}})", "if shm filled", instant=True)],
            w=6, unit="percentunit", thresholds=[(0.8, "orange"), (0.9, "red")])
    d.panel("bargauge", "GPU memory used",
            "Used / total per GPU. Serving engines preallocate ~90 % (vLLM --gpu-memory-utilization): that is normal; "
            "red is the last 2 %, where CUDA out of memory follows.",
            [q(f"shmwatch_gpu_memory_used_bytes{{{S}}} / shmwatch_gpu_memory_total_bytes{{{S}}}", "GPU {{gpu}}",
               instant=True)],
            w=6, unit="percentunit", thresholds=[(0.95, "orange"), (0.98, "red")], minmax=(0, 1))
    d.panel("table", "Firing alerts",
            "shmwatch alerts firing now (from Prometheus' ALERTS series). Each alert's runbook_url explains the fix.",
            [q('sum by (alertname, severity, mount) (ALERTS{alertstate="firing", '
               'alertname=~"Shm.*|Pod.*|Sysv.*|Gpu.*|HostMemory.*|Shmwatch.*"})', instant=True, table=True)],
            w=6, transformations=[{"id": "organize", "options": {"excludeByName": {"Time": True, "Value": True}}}])

    d.row("/dev/shm over time")
    d.panel("timeseries", "Used, size, effective size, peak",
            "Peak is the highest value seen by polls and inotify events within --peak-window: a burst between "
            "scrapes shows here. Effective size: what can really be filled (tmpfs size, sizeLimit, what the memory "
            "limit leaves). Used reaching effective size is a crash.",
            [q(f"shmwatch_mount_used_bytes{{{SM}}}", "used {{mount}}"),
             q(f"shmwatch_mount_peak_used_bytes{{{SM}}}", "peak {{mount}}"),
             q(f"shmwatch_mount_size_bytes{{{SM}}}", "size {{mount}}"),
             q(f"shmwatch_mount_effective_size_bytes{{{SM}}}", "effective size {{mount}}")],
            w=16, unit="bytes")
    d.panel("timeseries", "Unattributed bytes",
            "Used bytes no segment we could see accounts for: held by processes shmwatch may not read "
            "(see Exporter health: unreadable processes) or by the kernel. Run shmwatch as the workload's user.",
            [q(f"shmwatch_mount_unattributed_bytes{{{SM}}}", "{{mount}}")], w=8, unit="bytes")

    d.row("Segments: who filled it?")
    d.panel("timeseries", "Bytes by owner class",
            "Allocated bytes (what tmpfs charges) by who made the segment: nccl, ucx, torch, python_shm (vLLM/SGLang "
            "MessageQueue), mpi, ... A class that only grows is a leak.",
            [q(f"sum by (class) (shmwatch_segment_bytes{{{SM}}})", "{{class}}")], w=12, unit="bytes", stack=True)
    d.panel("timeseries", "Bytes by state",
            "linked: in the directory and held; hidden: unlinked but still mapped (df counts it, ls does not); "
            "orphan: held by nobody, leaked by a crashed engine. Orphans above zero for long: remove them.",
            [q(f"sum by (state) (shmwatch_segment_bytes{{{SM}}})", "{{state}}")], w=12, unit="bytes", stack=True)
    d.panel("table", "Largest segments",
            "The top segments by allocated bytes, with their owner (comm[pid], +N more holders). State orphan: safe to "
            "remove once no server can attach (rm /dev/shm/<name>).",
            [q(f"sort_desc(shmwatch_top_segment_bytes{{{SM}}})", instant=True, table=True)],
            w=12, h=10, unit="bytes",
            transformations=BYTES_TABLE)
    d.panel("table", "Processes holding shm",
            "Processes by the shm they map or hold open: the ones to restart when hidden segments pile up.",
            [q(f"sort_desc(shmwatch_process_shm_bytes{{{SM}}})", instant=True, table=True)],
            w=12, h=10, unit="bytes",
            transformations=BYTES_TABLE)
    d.panel("stat", "Leaked and hidden",
            "Orphan segments and their bytes, the age of the oldest, and hidden bytes. Orphans older than a few hours "
            "will not go away by themselves.",
            [q(f'sum(shmwatch_segments{{{SM}, state="orphan"}})', "orphan segments", instant=True),
             q(f'sum(shmwatch_segment_bytes{{{SM}, state="orphan"}})', "orphan bytes", instant=True),
             q(f"max(shmwatch_orphan_oldest_age_seconds{{{SM}}})", "oldest orphan", instant=True),
             q(f'sum(shmwatch_segment_bytes{{{SM}, state="hidden"}})', "hidden bytes", instant=True)],
            w=12, overrides=[
                {"matcher": {"id": "byName", "options": "orphan bytes"},
                 "properties": [{"id": "unit", "value": "bytes"}]},
                {"matcher": {"id": "byName", "options": "hidden bytes"},
                 "properties": [{"id": "unit", "value": "bytes"}]},
                {"matcher": {"id": "byName", "options": "oldest orphan"},
                 "properties": [{"id": "unit", "value": "s"}]}])
    d.panel("timeseries", "Segments created / deleted",
            "Seen by inotify within milliseconds (or by inventory diffs when polling). Creates with no deletes: a leak "
            "in the making.",
            [q(f"sum by (class, event) (rate(shmwatch_segment_events_total{{{SM}}}[$__rate_interval]))",
               "{{class}} {{event}}")], w=12, unit="ops")

    d.row("Memory: will the pod be OOM-killed?")
    d.panel("timeseries", "Container memory: usage vs limit, with the shm part",
            "The memory cgroup's usage, working set and limit, and the tmpfs (shmem) part of it: memory-backed /dev/shm "
            "counts against the limit.",
            [q(f"shmwatch_cgroup_memory_usage_bytes{{{S}}}", "usage"),
             q(f"shmwatch_cgroup_memory_working_set_bytes{{{S}}}", "working set"),
             q(f"shmwatch_cgroup_memory_shmem_bytes{{{S}}}", "shmem"),
             q(f"shmwatch_cgroup_memory_limit_bytes{{{S}}}", "limit")], w=12, unit="bytes")
    d.panel("timeseries", "OOM kills and projection",
            "OOM kills in the last hour, and (working set - shm used + shm size) / limit: above 1 (red), filling /dev/shm "
            "OOM-kills the pod before tmpfs says ENOSPC: lower sizeLimit or raise the memory limit.",
            [q(f"increase(shmwatch_cgroup_oom_kills_total{{{S}}}[1h])", "OOM kills (1h)"),
             q(f"shmwatch_shm_oom_projection_ratio{{{SM}}}", "projection {{mount}}")],
            w=6, thresholds=[(1, "red")])
    d.panel("timeseries", "Host memory",
            "Host RAM total, available and Shmem (all tmpfs and shm on the node). Available below 10 %: trouble.",
            [q(f"shmwatch_host_memory_total_bytes{{{S}}}", "total"),
             q(f"shmwatch_host_memory_available_bytes{{{S}}}", "available"),
             q(f"shmwatch_host_memory_shmem_bytes{{{S}}}", "shmem")], w=6, unit="bytes")

    d.row("SysV shared memory")
    d.panel("stat", "SysV segments vs kernel.shmmni",
            "shmget() segments (UCX sysv transport, older MPI) against the kernel's limit. Near the limit: ipcs -m, "
            "ipcrm -m <id> for orphans, or raise kernel.shmmni.",
            [q(f"sum(shmwatch_sysv_segments{{{S}}})", "segments", instant=True),
             q(f"sum(shmwatch_sysv_orphan_segments{{{S}}})", "orphans (nattch 0)", instant=True),
             q(f"max(shmwatch_sysv_limit_shmmni{{{S}}})", "shmmni", instant=True)], w=12)
    d.panel("timeseries", "SysV bytes vs kernel.shmall",
            "Total size of SysV segments; beyond kernel.shmall shmget() fails with ENOSPC.",
            [q(f"shmwatch_sysv_bytes{{{S}}}", "bytes"), q(f"shmwatch_sysv_resident_bytes{{{S}}}", "resident"),
             q(f"clamp_max(shmwatch_sysv_limit_shmall_bytes{{{S}}}, 1e15)", "shmall")], w=12, unit="bytes")

    d.row("GPU")
    d.panel("timeseries", "GPU memory per GPU",
            "Used, reserved and total memory per GPU (NVML). vLLM preallocates --gpu-memory-utilization of total.",
            [q(f"shmwatch_gpu_memory_used_bytes{{{S}}}", "used GPU {{gpu}}"),
             q(f"shmwatch_gpu_memory_reserved_bytes{{{S}}}", "reserved GPU {{gpu}}"),
             q(f"shmwatch_gpu_memory_total_bytes{{{S}}}", "total GPU {{gpu}}")], w=12, unit="bytes")
    d.panel("table", "GPU memory per process",
            "Who uses each GPU: pid and comm (unknown for a pid in another PID namespace).",
            [q(f"sort_desc(shmwatch_gpu_process_memory_bytes{{{S}}})", instant=True, table=True)],
            w=12, unit="bytes",
            transformations=BYTES_TABLE)

    d.row("Exporter health")
    d.panel("stat", "Collectors",
            "1 = the collector's last run succeeded. A 0 means its metrics are missing: the exporter's log says why "
            "once (GPU: no driver is normal on CPU nodes).",
            [q(f"min by (collector) (shmwatch_collector_success{{{S}}})", "{{collector}}", instant=True)],
            w=8, thresholds=[(0, "red"), (1, "green")],
            overrides=[], options={"colorMode": "background", "graphMode": "none"})
    d.panel("timeseries", "Collector duration",
            "Time of each collector's last run. The segment inventory grows with segments x processes.",
            [q(f"max by (collector) (shmwatch_collector_duration_seconds{{{S}}})", "{{collector}}")],
            w=8, unit="s")
    d.panel("stat", "inotify and /proc access",
            "inotify 1: new segments seen within milliseconds; 0: polled. Unreadable processes: owners shmwatch "
            "cannot see (run it as the workload's user or root).",
            [q(f"min(shmwatch_inotify_active{{{SM}}})", "inotify", instant=True),
             q(f"max(shmwatch_proc_unreadable{{{S}}})", "unreadable processes", instant=True)], w=8)
    d._newline()
    return d.panels


def variable(name, label, query, include_all=False, hide=0):
    v = {"name": name, "label": label, "type": "query", "datasource": DS, "refresh": 2, "sort": 1, "hide": hide,
         "query": {"query": query, "refId": f"{name}-query"}, "definition": query, "multi": include_all,
         "includeAll": include_all, "current": {}, "options": []}
    if include_all:
        v["allValue"] = ".*"
    return v


def dashboard():
    return {
        "uid": "shmwatch",
        "title": "shmwatch: shared memory, OOM risk and GPU memory",
        "description": "Is the GPU full? Is /dev/shm full, and who filled it? Will memory OOM-kill the pod? "
                       "Did NCCL/UCX/torch leave or hide segments?",
        "tags": ["shmwatch", "llm-serving", "shm"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "graphTooltip": 1,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "",
        "annotations": {"list": []},
        "links": [],
        "templating": {"list": [
            {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "options": []},
            variable("job", "Job", "label_values(shmwatch_build_info, job)", include_all=True),
            variable("instance", "Instance", 'label_values(shmwatch_build_info{job=~"$job"}, instance)',
                     include_all=True),
            variable("namespace", "Namespace", 'label_values(shmwatch_build_info{job=~"$job"}, namespace)',
                     include_all=True),
            variable("pod", "Pod", 'label_values(shmwatch_build_info{job=~"$job", namespace=~"$namespace"}, pod)',
                     include_all=True),
            variable("mount", "Mount",
                     'label_values(shmwatch_mount_size_bytes{job=~"$job", instance=~"$instance"}, mount)',
                     include_all=True),
        ]},
        "panels": build(),
    }


def main():
    with open(OUT, "w") as f:
        json.dump(dashboard(), f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    main()
