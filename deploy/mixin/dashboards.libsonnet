// The shmwatch dashboard (grafana/shmwatch.json), in plain jsonnet: one row per question,
// panels laid out left to right, 24 columns wide, like Grafana's own auto-layout.
local lib = import 'lib.libsonnet';
local DS = { type: 'prometheus', uid: '${datasource}' };

// A panel or row description; `layout` below gives it an id and a place on the grid.
local row(title) = { kind:: 'row', title: title };
local panel(kind,
            title,
            description,
            targets,
            w=8,
            h=8,
            unit=null,
            thresholds=null,
            stack=false,
            minmax=null,
            overrides=null,
            transformations=null,
            options=null) = {
                              kind:: 'panel',
                              w:: w,
                              h:: h,
                              type: kind,
                              title: title,
                              description: description,
                              datasource: DS,
                              fieldConfig: {
                                defaults: (if unit != null then { unit: unit } else {})
                                          + (if thresholds != null then {
                                               thresholds: { mode: 'absolute', steps: [{ color: 'green', value: null }]
                                                                                      + [{ color: t[1], value: t[0] } for t in thresholds] },
                                               color: { mode: 'thresholds' },
                                             } else {})
                                          + (if minmax != null then { min: minmax[0], max: minmax[1] } else {})
                                          + (if kind == 'timeseries' then {
                                               custom: {
                                                 fillOpacity: if stack then 30 else 10,
                                                 lineWidth: 1,
                                                 stacking: { mode: if stack then 'normal' else 'none', group: 'A' },
                                               },
                                             } else {}),
                                overrides: if overrides == null then [] else overrides,
                              },
                              targets: [
                                targets[i] { datasource: DS, refId: std.char(std.codepoint('A') + i) }
                                for i in std.range(0, std.length(targets) - 1)
                              ],
                            } + (if transformations != null then { transformations: transformations } else {})
                            + (if options != null then { options: options } else {});

local q(expr, legend='', instant=false, table=false) =
  { expr: expr, legendFormat: if legend == '' then '__auto' else legend }
  + (if instant then { instant: true, range: false } else {})
  + (if table then { format: 'table' } else {});

// Rows start a new line; a panel that does not fit the line starts the next one.
local layout(items) =
  local step(state, item) =
    local newline = { y: state.y + state.rowH, x: 0, rowH: 0 };
    if item.kind == 'row' then
      local s = state + newline;
      s {
        y: s.y + 1,
        id: state.id + 1,
        panels: state.panels + [item {
          type: 'row',
          id: state.id,
          collapsed: false,
          gridPos: { h: 1, w: 24, x: 0, y: s.y },
          panels: [],
        }],
      }
    else
      local s = if state.x + item.w > 24 then state + newline else state;
      s {
        x: s.x + item.w,
        rowH: std.max(s.rowH, item.h),
        id: state.id + 1,
        panels: state.panels + [item { id: state.id, gridPos: { h: item.h, w: item.w, x: s.x, y: s.y } }],
      };
  std.foldl(step, items, { x: 0, y: 0, rowH: 0, id: 1, panels: [] }).panels;

// Which pod a series is about depends on how shmwatch runs. Sidecar: the scrape's namespace
// and pod target labels are the workload's, no series has a pod_uid, and a mount's is its
// path (`mount`). Node mode (the DaemonSet): the target labels are the DaemonSet's own pod; a
// pod's series carry pod_uid, which shmwatch:pod_info (deploy/prometheus/shmwatch-node-rules.yml,
// from kube_pod_info) names, and a pod's mount is its `volume`. One dashboard serves both: each query is an `or` of the two shapes. group_left
// (namespace, pod) overwrites the DaemonSet's labels with the workload's (Prometheus sets the
// listed labels from the one side). "All" is ".*", which matches series without those labels.
local T = 'job=~"$job", instance=~"$instance"';
local WORKLOAD = 'namespace=~"$namespace", pod=~"$pod"';
local named(expr, workload=WORKLOAD) =
  '%s * on (pod_uid) group_left (namespace, pod) shmwatch:pod_info%s'
  % [expr, if workload == '' then '' else '{%s}' % workload];
// Node mode: the pods an exporter watches (a memory emptyDir, a memory cgroup or an IPC
// namespace of theirs), by pod_uid.
local watched(sel) =
  'group by (job, instance, pod_uid) (%s)'
  % std.join(' or ', [
    '%s{%s, pod_uid!=""}' % [m, sel]
    for m in ['shmwatch_mount_size_bytes', 'shmwatch_cgroup_memory_working_set_bytes', 'shmwatch_sysv_segments']
  ]);
local matchers(list) = std.join(', ', [m for m in list if m != '']);
// A series, in the shapes it comes in: the sidecar's by its target labels; node mode's
// pod series (pod=true) by pod_uid; node mode's node series (node=true: host memory, GPUs,
// the exporter's own, which no pod_uid names) from the exporter that watches the selected
// pod, i.e. the node the pod runs on. `over` wraps each selector (rate, increase) before the
// join: a range function needs the bare selector. `nodeOnly`: more matchers for node series.
// `mount`: the $mount variable picks a mount by its path, or a pod's by its volume.
local series(metric, mount=false, extra='', over='%s', pod=true, node=false, nodeOnly='') =
  local own = matchers([if mount then 'mount=~"$mount"' else '', extra]);
  local pods = matchers([if mount then 'volume=~"$mount"' else '', extra]);
  local s(list, m) = over % ('%s{%s}' % [metric, matchers(list + [m])]);
  '(%s)' % std.join(' or ', [s([T, WORKLOAD, 'pod_uid=""'], own)]
                            + (if pod then [named(s([T, 'pod_uid!=""'], pods))] else [])
                            + (if node then ['%s and on (job, instance) group by (job, instance) (%s)'
                                             % [s([T, 'pod_uid=""', nodeOnly], own), named(watched(T))]] else []));
local P(metric, mount=false, extra='', over='%s') = series(metric, mount, extra, over);
local N(metric) = series(metric, pod=false, node=true);
// A mount in a legend: its path (a sidecar's), or a pod's volume; and the pod it is of.
local MOUNT = '{{mount}}{{volume}}';
local CGROUP = '{{pod}} {{cgroup}}';

// Instant-query tables: hide the bookkeeping columns, call the value what it is.
local BYTES_TABLE = [{ id: 'organize', options: {
  excludeByName: { Time: true, __name__: true, job: true },
  renameByName: { Value: 'bytes' },
} }];
local bytesOverride(name, unit) = {
  matcher: { id: 'byName', options: name },
  properties: [{ id: 'unit', value: unit }],
};

// c: the mixin's _config (thresholds follow the alerts').
local panels(c) = [
  row('Overview: is anything about to fail?'),
  panel('gauge',
        '/dev/shm usage',
        'Used / size of each watched tmpfs. Red (95 %): the next NCCL/UCX/vLLM segment fails with ENOSPC or '
        + 'SIGBUS. Look at the Segments row for who holds it; clean leaked segments or raise --shm-size / '
        + 'shm_size / the emptyDir sizeLimit.',
        [q('max by (mount, volume) (%s)' % P('shmwatch:mount_usage_ratio', mount=true), MOUNT, instant=true)],
        w=6,
        unit='percentunit',
        thresholds=[[c.shmUsageWarningRatio, 'orange'], [c.shmUsageCriticalRatio, 'red']],
        minmax=[0, 1]),
  panel('stat',
        'OOM risk (working set / limit)',
        'Working set of the watched memory cgroup over its limit; tmpfs pages count in it. Red (90 %): the OOM '
        + 'killer is close. Empty when there is no limit.',
        [
          q('max by (cgroup) (%s)' % P('shmwatch:oom_risk_ratio'), 'risk', instant=true),
          q('max by (mount, volume) (%s)' % P('shmwatch_shm_oom_projection_ratio', mount=true),
            'if shm filled',
            instant=true),
        ],
        w=6,
        unit='percentunit',
        thresholds=[[0.8, 'orange'], [c.oomRiskRatio, 'red']]),
  panel('bargauge',
        'GPU memory used',
        'Used / total per GPU. Serving engines preallocate ~90 % (vLLM --gpu-memory-utilization): that is normal; '
        + 'red is the last 2 %, where CUDA out of memory follows.',
        [q('%s / %s' % [N('shmwatch_gpu_memory_used_bytes'), N('shmwatch_gpu_memory_total_bytes')],
           'GPU {{gpu}}',
           instant=true)],
        w=6,
        unit='percentunit',
        thresholds=[[0.95, 'orange'], [c.gpuMemoryUsedRatio, 'red']],
        minmax=[0, 1]),
  panel('table',
        'Firing alerts',
        "shmwatch alerts firing now (from Prometheus' ALERTS series). Each alert's runbook_url explains the fix.",
        [q('sum by (alertname, severity, mount, volume) (%s)'
           % series('ALERTS',
                    extra='alertstate="firing", alertname=~"Shm.*|Pod.*|Sysv.*|Gpu.*|HostMemory.*|Shmwatch.*"',
                    // Of a node-mode exporter's other alerts, the node's own (not its
                    // host /dev/shm's or other pods' ones) concern the pod on that node.
                    node=true,
                    nodeOnly='alertname=~"HostMemory.*|Gpu.*|Shmwatch.*"'),
           instant=true,
           table=true)],
        w=6,
        transformations=[{ id: 'organize', options: { excludeByName: { Time: true, Value: true } } }]),

  row('/dev/shm over time'),
  panel('timeseries',
        'Used, size, effective size, peak',
        'Peak is the highest value seen by polls and inotify events within --peak-window: a burst between '
        + 'scrapes shows here. Effective size: what can really be filled (tmpfs size, sizeLimit, what the memory '
        + 'limit leaves). Used reaching effective size is a crash.',
        [
          q(P('shmwatch_mount_used_bytes', mount=true), 'used {{pod}} ' + MOUNT),
          q(P('shmwatch_mount_peak_used_bytes', mount=true), 'peak {{pod}} ' + MOUNT),
          q(P('shmwatch_mount_size_bytes', mount=true), 'size {{pod}} ' + MOUNT),
          q(P('shmwatch_mount_effective_size_bytes', mount=true), 'effective size {{pod}} ' + MOUNT),
        ],
        w=24,
        unit='bytes'),

  row('Right-sizing: how big should shm be?'),
  panel('timeseries',
        'Recommended vs configured size',
        'Recommended: the highest peak over %s x %s, rounded up to a whole GiB (MiB below 1 GiB); the peak '
        % [c.recommendationWindow, lib.num(c.recommendationHeadroom)]
        + 'that drove it, and the high-water mark since shmwatch first saw the mount. A peak that never happened '
        + 'while shmwatch watched is not in it. shmwatch check --recommend prints the settings to apply.',
        [
          q(P('shmwatch:mount_recommended_size_bytes', mount=true), 'recommended {{pod}} ' + MOUNT),
          q(P('shmwatch_mount_size_bytes', mount=true), 'configured {{pod}} ' + MOUNT),
          q(P('shmwatch:mount_observed_peak_bytes', mount=true), 'peak over %s {{pod}} %s' % [c.recommendationWindow, MOUNT]),
          q(P('shmwatch_mount_max_used_bytes', mount=true), 'high-water mark {{pod}} ' + MOUNT),
        ],
        w=16,
        unit='bytes'),
  panel('timeseries',
        'Memory limit the recommendation needs',
        'The memory limit that holds a full recommended mount besides the rest of the working set (tmpfs pages '
        + 'are charged to the pod), against the limit now. Above it, the limit must grow, not only the shm size '
        + '(ShmRecommendationExceedsMemoryLimit).',
        [
          q(P('shmwatch:mount_recommended_memory_limit_bytes', mount=true), 'needed {{pod}} ' + MOUNT),
          q(P('shmwatch_cgroup_memory_limit_bytes'), 'limit ' + CGROUP),
        ],
        w=8,
        unit='bytes'),

  row('Segments: who filled it?'),
  panel('timeseries',
        'Bytes by owner class',
        'Allocated bytes (what tmpfs charges) by who made the segment: nccl, ucx, torch, python_shm (vLLM/SGLang '
        + 'MessageQueue), mpi, ... A class that only grows is a leak.',
        [q('sum by (class) (%s)' % P('shmwatch_segment_bytes', mount=true), '{{class}}')],
        w=12,
        unit='bytes',
        stack=true),
  panel('timeseries',
        'Bytes by state',
        'linked: in the directory and held; hidden: unlinked but still mapped (df counts it, ls does not); '
        + 'orphan: held by nobody (every process inspected), leaked by a crashed engine; unverified: held by '
        + 'nobody shmwatch could inspect, may be live (see /proc access below). Orphans above zero for long: '
        + 'remove them.',
        [q('sum by (state) (%s)' % P('shmwatch_segment_bytes', mount=true), '{{state}}')],
        w=12,
        unit='bytes',
        stack=true),
  panel('table',
        'Largest segments',
        'The segments each exporter names (--segments.top-k of them): orphans first, then the largest of those '
        + 'last modified over a minute ago, with the process name (comm) of their first holder; a segment that '
        + "lives seconds is never named (shmwatch check names every one, with its holders' pids). State orphan: "
        + 'safe to remove once no server can attach (rm -- /dev/shm/<name>), unless its class is other. State '
        + 'unverified: never remove: shmwatch could not inspect every process, so it may be live. State hidden: '
        + 'restart the owner to free it.',
        [q('sort_desc(%s)' % P('shmwatch_top_segment_bytes', mount=true), instant=true, table=true)],
        w=12,
        h=10,
        unit='bytes',
        transformations=BYTES_TABLE),
  panel('stat',
        'Leaked and hidden',
        'Orphan segments and their bytes, the age of the oldest, and hidden bytes. Orphans older than a few hours '
        + 'will not go away by themselves.',
        [
          q('sum(%s)' % P('shmwatch_segments', mount=true, extra='state="orphan"'), 'orphan segments', instant=true),
          q('sum(%s)' % P('shmwatch_segment_bytes', mount=true, extra='state="orphan"'), 'orphan bytes', instant=true),
          q('max(%s)' % P('shmwatch_orphan_oldest_age_seconds', mount=true), 'oldest orphan', instant=true),
          q('sum(%s)' % P('shmwatch_segment_bytes', mount=true, extra='state="hidden"'), 'hidden bytes', instant=true),
        ],
        w=12,
        overrides=[
          bytesOverride('orphan bytes', 'bytes'),
          bytesOverride('hidden bytes', 'bytes'),
          bytesOverride('oldest orphan', 's'),
        ]),
  panel('timeseries',
        'Segments by class',
        'How many segments each class has, by state. A count that only grows (orphans above all): a leak in the '
        + 'making. Creates and deletes as they happen: the opt-in shmwatch_segment_events_total '
        + '(--metric-opt-in-list=shmwatch_segment_events).',
        [q('sum by (class, state) (%s)' % P('shmwatch_segments', mount=true), '{{class}} {{state}}')],
        w=24),

  row('Memory: will the pod be OOM-killed?'),
  panel('timeseries',
        'Container memory: working set vs limit, with the shm part',
        "The memory cgroup's working set and limit, and the tmpfs (shmem) part of it: memory-backed /dev/shm "
        + "counts against the limit. A sidecar that cannot read the workload's cgroup estimates it from the "
        + "workload's processes and the shm used: cgroup \"estimate:workload\". Usage and the shmem no watched "
        + 'mount, SysV segment or memfd region explains are opt-in (shmwatch_cgroup_memory_usage_bytes, '
        + 'shmwatch_cgroup_memory_shmem_unexplained_bytes: --metric-opt-in-list).',
        [
          q(P('shmwatch_cgroup_memory_working_set_bytes'), 'working set ' + CGROUP),
          q(P('shmwatch_cgroup_memory_shmem_bytes'), 'shmem ' + CGROUP),
          q(P('shmwatch_cgroup_memory_limit_bytes'), 'limit ' + CGROUP),
        ],
        w=12,
        unit='bytes'),
  panel('timeseries',
        'OOM kills and projection',
        'OOM kills in the last hour (node mode: from the kernel log, per pod, also after the container is gone), and '
        + '(working set - shm used + shm size) / limit: above 1 (red), filling /dev/shm '
        + 'OOM-kills the pod before tmpfs says ENOSPC: lower sizeLimit or raise the memory limit.',
        [
          q(P('shmwatch_cgroup_oom_kills_total', over='increase(%s[1h])'), 'OOM kills (1h)'),
          q(P('shmwatch_shm_oom_projection_ratio', mount=true), 'projection {{pod}} ' + MOUNT),
        ],
        w=6,
        thresholds=[[c.shmOomProjectionRatio, 'red']]),
  panel('timeseries',
        'Host memory',
        'Host RAM total, available and Shmem (all tmpfs and shm on the node). Available below 10 %: trouble.',
        [
          q(N('shmwatch_host_memory_total_bytes'), 'total'),
          q(N('shmwatch_host_memory_available_bytes'), 'available'),
          q(N('shmwatch_host_memory_shmem_bytes'), 'shmem'),
        ],
        w=6,
        unit='bytes'),

  panel('timeseries',
        'memory.high and the shm under it',
        'memory.high (MemoryQoS) and the tmpfs (shmem) charged to the cgroup. Above memory.high the kernel '
        + 'throttles and reclaims, and tmpfs pages cannot be reclaimed without swap: a shm-heavy pod stalls '
        + "rather than being killed (alert PodThrottledAtMemoryHigh). A pod's cgroup (node mode) has no "
        + "memory.high of its own (MemoryQoS sets its containers'): once its memory.events counts them "
        + 'throttled, its limit is drawn instead, as the alert takes it.',
        [
          q(P('shmwatch_cgroup_memory_high_bytes'), 'memory.high ' + CGROUP),
          q('%s and on (job, instance, cgroup, pod_uid) %s > 0'
            % [P('shmwatch_cgroup_memory_limit_bytes'), P('shmwatch_cgroup_memory_events_total', extra='event="high"')],
            'limit %s (throttled under it)' % CGROUP),
          q(P('shmwatch_cgroup_memory_shmem_bytes'), 'shmem ' + CGROUP),
        ],
        w=12,
        unit='bytes'),
  panel('timeseries',
        'Memory events: throttling at memory.high',
        'How often each cgroup went over memory.high (high: throttled and reclaimed), hit memory.max (max), ran '
        + 'out of memory (oom) or had a process OOM-killed (oom_kill), per second (memory.events).',
        [q(P('shmwatch_cgroup_memory_events_total', over='rate(%s[$__rate_interval])'), '{{event}} ' + CGROUP)],
        w=12,
        unit='ops'),
  row('SysV shared memory'),
  panel('stat',
        'SysV segments vs kernel.shmmni',
        "shmget() segments (UCX sysv transport, older MPI) against the kernel's limit. Near the limit: ipcs -m, "
        + 'ipcrm -m <id> for orphans, or raise kernel.shmmni. Node mode reads each IPC namespace (pod); those it '
        + 'could not enter (no CAP_SYS_ADMIN) are counted as not readable, not as empty.',
        [
          q('sum(%s)' % P('shmwatch_sysv_segments'), 'segments', instant=true),
          q('sum(%s)' % P('shmwatch_sysv_orphan_segments'), 'orphans (nattch 0)', instant=true),
          q('max(%s)' % P('shmwatch_sysv_limit_shmmni'), 'shmmni', instant=true),
          q('count(%s == 0) or vector(0)' % P('shmwatch_sysv_namespace_readable'),
            'namespaces not readable',
            instant=true),
        ],
        w=12),
  panel('timeseries',
        'SysV bytes vs kernel.shmall',
        'Total size of SysV segments; beyond kernel.shmall shmget() fails with ENOSPC.',
        [
          q(P('shmwatch_sysv_bytes'), 'bytes'),
          q('clamp_max(%s, 1e15)' % P('shmwatch_sysv_limit_shmall_bytes'), 'shmall'),
        ],
        w=12,
        unit='bytes'),

  row('GPU'),
  panel('timeseries',
        'GPU memory per GPU',
        'Used, reserved and total memory per GPU (NVML). vLLM preallocates --gpu-memory-utilization of total.',
        [
          q(N('shmwatch_gpu_memory_used_bytes'), 'used GPU {{gpu}}'),
          q(N('shmwatch_gpu_memory_reserved_bytes'), 'reserved GPU {{gpu}}'),
          q(N('shmwatch_gpu_memory_total_bytes'), 'total GPU {{gpu}}'),
        ],
        w=12,
        unit='bytes'),
  panel('table',
        'GPU memory per process',
        'Who uses each GPU: by process name (comm; unknown for a process in another PID namespace), summed, '
        + "and in node mode the processes' pod (process_pod_uid). shmwatch check names each pid.",
        [q('sort_desc(%s)' % N('shmwatch_gpu_process_memory_bytes'), instant=true, table=true)],
        w=12,
        unit='bytes',
        transformations=BYTES_TABLE),

  row('Exporter health'),
  panel('stat',
        'Collectors',
        "1 = the collector's last run succeeded. A 0 means its metrics are missing: the exporter's log says why "
        + 'once (GPU: no driver is normal on CPU nodes).',
        [q('min by (collector) (%s)' % N('shmwatch_collector_success'), '{{collector}}', instant=true)],
        w=6,
        thresholds=[[0, 'red'], [1, 'green']],
        overrides=[],
        options={ colorMode: 'background', graphMode: 'none' }),
  panel('timeseries',
        'Collector duration',
        "Time of each collector's last run. The segment inventory grows with segments x processes.",
        [q('max by (collector) (%s)' % N('shmwatch_collector_duration_seconds'), '{{collector}}')],
        w=6,
        unit='s'),
  panel('stat',
        '/proc access',
        'Processes shmwatch could not inspect: the owners it cannot see. Above 0, segments held by nobody it could '
        + "inspect are unverified, not orphan: run shmwatch as the server's UID or with CAP_SYS_PTRACE. (Per mount: "
        + 'shmwatch_mount_owners_verified; inotify or polling: shmwatch_inotify_active; both opt-in: '
        + '--metric-opt-in-list.)',
        [q('max(%s)' % N('shmwatch_proc_unreadable'), 'unreadable processes', instant=true)],
        w=6),
  panel('stat',
        'Inventory degraded',
        '1: the mount holds more files than --inventory.max-segments (counted by class only), or more entries '
        + 'than a walk reads (the files not reached kept as last seen). Nothing in it is called leaked, so '
        + '"Leaked and hidden" cannot show a leak: a leak storm, most likely; Bytes by owner class says whose.',
        [q('max by (mount, volume) (%s)' % P('shmwatch_inventory_degraded', mount=true), MOUNT, instant=true)],
        w=6,
        thresholds=[[1, 'red']],
        options={ colorMode: 'background', graphMode: 'none' }),
];

local variable(name, label, query, includeAll=false, hide=0, regex='') = {
                                                                           name: name,
                                                                           label: label,
                                                                           type: 'query',
                                                                           datasource: DS,
                                                                           refresh: 2,
                                                                           sort: 1,
                                                                           hide: hide,
                                                                           query: { query: query, refId: name + '-query' },
                                                                           definition: query,
                                                                           multi: includeAll,
                                                                           includeAll: includeAll,
                                                                           current: {},
                                                                           options: [],
                                                                         } + (if includeAll then { allValue: '.*' } else {})
                                                                         + (if regex != '' then { regex: regex } else {});

// The workload pods of both shapes, for the namespace and pod lists: a sidecar's target
// labels (an exporter that watches no pod_uid is a sidecar), and in node mode the pods each
// exporter watches, named by shmwatch:pod_info (never the DaemonSet's own target labels).
// query_result, not label_values: label_values takes one series selector, and this is an
// expression; the regex picks the label out of each result line.
local workloads(label, sel) =
  'query_result(group by (%s) (' % label
  + '(group by (job, instance, namespace, pod) (shmwatch_build_info{%s}) unless on (job, instance) %s)'
    % [matchers(['job=~"$job"', sel]), watched('job=~"$job"')]
  + ' or %s))' % named(watched('job=~"$job"'), sel);
local workloadVariable(name, label, sel) =
  variable(name, label, workloads(name, sel), includeAll=true, regex='/%s="([^"]+)"/' % name);

{
  grafanaDashboards+:: {
    local c = $._config,
    'shmwatch.json': {
      uid: c.dashboardUid,
      title: c.dashboardTitle,
      description: 'Is the GPU full? Is /dev/shm full, and who filled it? Will memory OOM-kill the pod? '
                   + 'Did NCCL/UCX/torch leave or hide segments?',
      tags: ['shmwatch', 'llm-serving', 'shm'],
      schemaVersion: 39,
      version: 1,
      editable: true,
      graphTooltip: 1,
      time: { from: c.dashboardTimeFrom, to: 'now' },
      refresh: c.dashboardRefresh,
      timezone: '',
      annotations: { list: [] },
      links: [],
      templating: { list: [
        {
          name: 'datasource',
          label: 'Data source',
          type: 'datasource',
          query: 'prometheus',
          current: {},
          hide: 0,
          refresh: 1,
          options: [],
        },
        variable('job', 'Job', 'label_values(shmwatch_build_info, job)', includeAll=true),
        variable('instance',
                 'Instance',
                 'label_values(shmwatch_build_info{job=~"$job"}, instance)',
                 includeAll=true),
        workloadVariable('namespace', 'Namespace', ''),
        workloadVariable('pod', 'Pod', 'namespace=~"$namespace"'),
        // A sidecar's mounts by their path, node mode's pods' by their volume.
        variable('mount',
                 'Mount',
                 'query_result(group by (mount, volume) (shmwatch_mount_size_bytes{job=~"$job", instance=~"$instance"}))',
                 includeAll=true,
                 regex='/(?:mount|volume)="([^"]+)"/'),
      ] },
      panels: layout(panels(c)),
    },
  },
}
