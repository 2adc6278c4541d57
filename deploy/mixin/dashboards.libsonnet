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

// Every query carries these; namespace/pod match series without those labels too (".*").
local S = 'job=~"$job", instance=~"$instance", namespace=~"$namespace", pod=~"$pod"';
local SM = S + ', mount=~"$mount"';

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
        [q('max by (mount) (shmwatch_mount_usage_ratio{%s})' % SM, '{{mount}}', instant=true)],
        w=6,
        unit='percentunit',
        thresholds=[[c.shmUsageWarningRatio, 'orange'], [c.shmUsageCriticalRatio, 'red']],
        minmax=[0, 1]),
  panel('stat',
        'OOM risk (working set / limit)',
        'Working set of the watched memory cgroup over its limit; tmpfs pages count in it. Red (90 %): the OOM '
        + 'killer is close. Empty when there is no limit.',
        [
          q('max by (cgroup) (shmwatch_oom_risk_ratio{%s})' % S, 'risk', instant=true),
          q('max by (mount) (shmwatch_shm_oom_projection_ratio{%s})' % SM, 'if shm filled', instant=true),
        ],
        w=6,
        unit='percentunit',
        thresholds=[[0.8, 'orange'], [c.oomRiskRatio, 'red']]),
  panel('bargauge',
        'GPU memory used',
        'Used / total per GPU. Serving engines preallocate ~90 % (vLLM --gpu-memory-utilization): that is normal; '
        + 'red is the last 2 %, where CUDA out of memory follows.',
        [q('shmwatch_gpu_memory_used_bytes{%s} / shmwatch_gpu_memory_total_bytes{%s}' % [S, S],
           'GPU {{gpu}}',
           instant=true)],
        w=6,
        unit='percentunit',
        thresholds=[[0.95, 'orange'], [c.gpuMemoryUsedRatio, 'red']],
        minmax=[0, 1]),
  panel('table',
        'Firing alerts',
        "shmwatch alerts firing now (from Prometheus' ALERTS series). Each alert's runbook_url explains the fix.",
        [q('sum by (alertname, severity, mount) (ALERTS{alertstate="firing", '
           + 'alertname=~"Shm.*|Pod.*|Sysv.*|Gpu.*|HostMemory.*|Shmwatch.*"})', instant=true, table=true)],
        w=6,
        transformations=[{ id: 'organize', options: { excludeByName: { Time: true, Value: true } } }]),

  row('/dev/shm over time'),
  panel('timeseries',
        'Used, size, effective size, peak',
        'Peak is the highest value seen by polls and inotify events within --peak-window: a burst between '
        + 'scrapes shows here. Effective size: what can really be filled (tmpfs size, sizeLimit, what the memory '
        + 'limit leaves). Used reaching effective size is a crash.',
        [
          q('shmwatch_mount_used_bytes{%s}' % SM, 'used {{mount}}'),
          q('shmwatch_mount_peak_used_bytes{%s}' % SM, 'peak {{mount}}'),
          q('shmwatch_mount_size_bytes{%s}' % SM, 'size {{mount}}'),
          q('shmwatch_mount_effective_size_bytes{%s}' % SM, 'effective size {{mount}}'),
        ],
        w=16,
        unit='bytes'),
  panel('timeseries',
        'Unattributed bytes',
        'Used bytes no segment we could see accounts for: held by processes shmwatch may not read '
        + "(see Exporter health: unreadable processes) or by the kernel. Run shmwatch as the workload's user.",
        [q('shmwatch_mount_unattributed_bytes{%s}' % SM, '{{mount}}')],
        w=8,
        unit='bytes'),

  row('Right-sizing: how big should shm be?'),
  panel('timeseries',
        'Recommended vs configured size',
        'Recommended: the highest peak over %s x %s, rounded up to a whole GiB (MiB below 1 GiB); the peak '
        % [c.recommendationWindow, lib.num(c.recommendationHeadroom)]
        + 'that drove it, and the high-water mark since shmwatch first saw the mount. A peak that never happened '
        + 'while shmwatch watched is not in it. shmwatch check --recommend prints the settings to apply.',
        [
          q('shmwatch:mount_recommended_size_bytes{%s}' % SM, 'recommended {{mount}}'),
          q('shmwatch_mount_size_bytes{%s}' % SM, 'configured {{mount}}'),
          q('shmwatch:mount_observed_peak_bytes{%s}' % SM, 'peak over %s {{mount}}' % c.recommendationWindow),
          q('shmwatch_mount_max_used_bytes{%s}' % SM, 'high-water mark {{mount}}'),
        ],
        w=16,
        unit='bytes'),
  panel('timeseries',
        'Memory limit the recommendation needs',
        'The memory limit that holds a full recommended mount besides the rest of the working set (tmpfs pages '
        + 'are charged to the pod), against the limit now. Above it, the limit must grow, not only the shm size '
        + '(ShmRecommendationExceedsMemoryLimit).',
        [
          q('shmwatch:mount_recommended_memory_limit_bytes{%s}' % SM, 'needed {{mount}}'),
          q('shmwatch_cgroup_memory_limit_bytes{%s}' % S, 'limit {{cgroup}}'),
        ],
        w=8,
        unit='bytes'),

  row('Segments: who filled it?'),
  panel('timeseries',
        'Bytes by owner class',
        'Allocated bytes (what tmpfs charges) by who made the segment: nccl, ucx, torch, python_shm (vLLM/SGLang '
        + 'MessageQueue), mpi, ... A class that only grows is a leak.',
        [q('sum by (class) (shmwatch_segment_bytes{%s})' % SM, '{{class}}')],
        w=12,
        unit='bytes',
        stack=true),
  panel('timeseries',
        'Bytes by state',
        'linked: in the directory and held; hidden: unlinked but still mapped (df counts it, ls does not); '
        + 'orphan: held by nobody (every process inspected), leaked by a crashed engine; unverified: held by '
        + 'nobody shmwatch could inspect, may be live (see /proc access below). Orphans above zero for long: '
        + 'remove them.',
        [q('sum by (state) (shmwatch_segment_bytes{%s})' % SM, '{{state}}')],
        w=12,
        unit='bytes',
        stack=true),
  panel('table',
        'Largest segments',
        'The top segments by allocated bytes, with their owner (comm[pid], +N more holders). State orphan: safe to '
        + 'remove once no server can attach (rm /dev/shm/<name>), unless its class is other. State unverified: '
        + 'never remove: shmwatch could not inspect every process, so it may be live.',
        [q('sort_desc(shmwatch_top_segment_bytes{%s})' % SM, instant=true, table=true)],
        w=12,
        h=10,
        unit='bytes',
        transformations=BYTES_TABLE),
  panel('table',
        'Processes holding shm',
        'Processes by the shm they map or hold open: the ones to restart when hidden segments pile up.',
        [q('sort_desc(shmwatch_process_shm_bytes{%s})' % SM, instant=true, table=true)],
        w=12,
        h=10,
        unit='bytes',
        transformations=BYTES_TABLE),
  panel('stat',
        'Leaked and hidden',
        'Orphan segments and their bytes, the age of the oldest, and hidden bytes. Orphans older than a few hours '
        + 'will not go away by themselves.',
        [
          q('sum(shmwatch_segments{%s, state="orphan"})' % SM, 'orphan segments', instant=true),
          q('sum(shmwatch_segment_bytes{%s, state="orphan"})' % SM, 'orphan bytes', instant=true),
          q('max(shmwatch_orphan_oldest_age_seconds{%s})' % SM, 'oldest orphan', instant=true),
          q('sum(shmwatch_segment_bytes{%s, state="hidden"})' % SM, 'hidden bytes', instant=true),
        ],
        w=12,
        overrides=[
          bytesOverride('orphan bytes', 'bytes'),
          bytesOverride('hidden bytes', 'bytes'),
          bytesOverride('oldest orphan', 's'),
        ]),
  panel('timeseries',
        'Segments created / deleted',
        'Seen by inotify within milliseconds (or by inventory diffs when polling). Creates with no deletes: a leak '
        + 'in the making.',
        [q('sum by (class, event) (rate(shmwatch_segment_events_total{%s}[$__rate_interval]))' % SM,
           '{{class}} {{event}}')],
        w=12,
        unit='ops'),

  row('Memory: will the pod be OOM-killed?'),
  panel('timeseries',
        'Container memory: usage vs limit, with the shm part',
        "The memory cgroup's usage, working set and limit, and the tmpfs (shmem) part of it: memory-backed /dev/shm "
        + "counts against the limit. A sidecar that cannot read the workload's cgroup estimates it from the "
        + "workload's processes and the shm used: cgroup \"estimate:workload\" (shmwatch_cgroup_memory_estimated 1).",
        [
          q('shmwatch_cgroup_memory_usage_bytes{%s}' % S, 'usage {{cgroup}}'),
          q('shmwatch_cgroup_memory_working_set_bytes{%s}' % S, 'working set {{cgroup}}'),
          q('shmwatch_cgroup_memory_shmem_bytes{%s}' % S, 'shmem {{cgroup}}'),
          q('shmwatch_cgroup_memory_limit_bytes{%s}' % S, 'limit {{cgroup}}'),
        ],
        w=12,
        unit='bytes'),
  panel('timeseries',
        'OOM kills and projection',
        'OOM kills in the last hour (node mode: from the kernel log, per pod, also after the container is gone), and '
        + '(working set - shm used + shm size) / limit: above 1 (red), filling /dev/shm '
        + 'OOM-kills the pod before tmpfs says ENOSPC: lower sizeLimit or raise the memory limit.',
        [
          q('increase(shmwatch_cgroup_oom_kills_total{%s}[1h])' % S, 'OOM kills (1h)'),
          q('shmwatch_shm_oom_projection_ratio{%s}' % SM, 'projection {{mount}}'),
        ],
        w=6,
        thresholds=[[c.shmOomProjectionRatio, 'red']]),
  panel('timeseries',
        'Host memory',
        'Host RAM total, available and Shmem (all tmpfs and shm on the node). Available below 10 %: trouble.',
        [
          q('shmwatch_host_memory_total_bytes{%s}' % S, 'total'),
          q('shmwatch_host_memory_available_bytes{%s}' % S, 'available'),
          q('shmwatch_host_memory_shmem_bytes{%s}' % S, 'shmem'),
        ],
        w=6,
        unit='bytes'),

  row('SysV shared memory'),
  panel('stat',
        'SysV segments vs kernel.shmmni',
        "shmget() segments (UCX sysv transport, older MPI) against the kernel's limit. Near the limit: ipcs -m, "
        + 'ipcrm -m <id> for orphans, or raise kernel.shmmni. Node mode reads each IPC namespace (pod); those it '
        + 'could not enter (no CAP_SYS_ADMIN) are counted as not readable, not as empty.',
        [
          q('sum(shmwatch_sysv_segments{%s})' % S, 'segments', instant=true),
          q('sum(shmwatch_sysv_orphan_segments{%s})' % S, 'orphans (nattch 0)', instant=true),
          q('max(shmwatch_sysv_limit_shmmni{%s})' % S, 'shmmni', instant=true),
          q('count(shmwatch_sysv_namespace_readable{%s} == 0) or vector(0)' % S,
            'namespaces not readable',
            instant=true),
        ],
        w=12),
  panel('timeseries',
        'SysV bytes vs kernel.shmall',
        'Total size of SysV segments; beyond kernel.shmall shmget() fails with ENOSPC.',
        [
          q('shmwatch_sysv_bytes{%s}' % S, 'bytes'),
          q('shmwatch_sysv_resident_bytes{%s}' % S, 'resident'),
          q('clamp_max(shmwatch_sysv_limit_shmall_bytes{%s}, 1e15)' % S, 'shmall'),
        ],
        w=12,
        unit='bytes'),

  row('GPU'),
  panel('timeseries',
        'GPU memory per GPU',
        'Used, reserved and total memory per GPU (NVML). vLLM preallocates --gpu-memory-utilization of total.',
        [
          q('shmwatch_gpu_memory_used_bytes{%s}' % S, 'used GPU {{gpu}}'),
          q('shmwatch_gpu_memory_reserved_bytes{%s}' % S, 'reserved GPU {{gpu}}'),
          q('shmwatch_gpu_memory_total_bytes{%s}' % S, 'total GPU {{gpu}}'),
        ],
        w=12,
        unit='bytes'),
  panel('table',
        'GPU memory per process',
        'Who uses each GPU: pid and comm (unknown for a pid in another PID namespace).',
        [q('sort_desc(shmwatch_gpu_process_memory_bytes{%s})' % S, instant=true, table=true)],
        w=12,
        unit='bytes',
        transformations=BYTES_TABLE),

  row('Exporter health'),
  panel('stat',
        'Collectors',
        "1 = the collector's last run succeeded. A 0 means its metrics are missing: the exporter's log says why "
        + 'once (GPU: no driver is normal on CPU nodes).',
        [q('min by (collector) (shmwatch_collector_success{%s})' % S, '{{collector}}', instant=true)],
        w=8,
        thresholds=[[0, 'red'], [1, 'green']],
        overrides=[],
        options={ colorMode: 'background', graphMode: 'none' }),
  panel('timeseries',
        'Collector duration',
        "Time of each collector's last run. The segment inventory grows with segments x processes.",
        [q('max by (collector) (shmwatch_collector_duration_seconds{%s})' % S, '{{collector}}')],
        w=8,
        unit='s'),
  panel('stat',
        'inotify and /proc access',
        'inotify 1: new segments seen within milliseconds; 0: polled. Unreadable processes: owners shmwatch '
        + 'cannot see. Owners verified 0: segments held by nobody it could inspect are unverified, not orphan; '
        + "run shmwatch as the server's UID or with CAP_SYS_PTRACE.",
        [
          q('min(shmwatch_inotify_active{%s})' % SM, 'inotify', instant=true),
          q('max(shmwatch_proc_unreadable{%s})' % S, 'unreadable processes', instant=true),
          q('min(shmwatch_mount_owners_verified{%s})' % SM, 'owners verified', instant=true),
        ],
        w=8),
];

local variable(name, label, query, includeAll=false, hide=0) = {
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
} + (if includeAll then { allValue: '.*' } else {});

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
        variable('namespace',
                 'Namespace',
                 'label_values(shmwatch_build_info{job=~"$job"}, namespace)',
                 includeAll=true),
        variable('pod',
                 'Pod',
                 'label_values(shmwatch_build_info{job=~"$job", namespace=~"$namespace"}, pod)',
                 includeAll=true),
        variable('mount',
                 'Mount',
                 'label_values(shmwatch_mount_size_bytes{job=~"$job", instance=~"$instance"}, mount)',
                 includeAll=true),
      ] },
      panels: layout(panels(c)),
    },
  },
}
