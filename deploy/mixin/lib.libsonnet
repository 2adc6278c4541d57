// Small helpers shared by the alerts, rules and dashboard (no third-party jsonnet).
{
  // A number as PromQL text: jsonnet's own formatting writes 0.8 as 0.80000000000000004.
  num(x):: if std.floor(x) == x then '%d' % x else '%g' % x,
  // A ||| text block as one line (what YAML's folded `>-` made of the same text).
  oneLine(text):: std.join(' ', std.split(std.rstripChars(text, '\n'), '\n')),
  // A mount as an alert's text names it: its path, or in node mode, where its labels are its
  // pod and volume (or its container) instead, those.
  mountName:: '{{ if $labels.mount }}{{ $labels.mount }}{{ else if $labels.volume }}volume {{ $labels.volume }} '
              + 'of pod {{ $labels.pod_uid }}{{ else }}the shm of container {{ $labels.container_id }}{{ end }}',
  // A cgroup: its path, or in node mode a pod's by its pod_uid.
  cgroupName:: '{{ if $labels.cgroup }}{{ $labels.cgroup }}{{ else }}of pod {{ $labels.pod_uid }}{{ end }}',
  // An alert's annotations with its mount and cgroup named so.
  named(annotations):: {
    [k]: std.strReplace(std.strReplace(annotations[k], '{{ $labels.mount }}', $.mountName),
                        '{{ $labels.cgroup }}',
                        $.cgroupName)
    for k in std.objectFields(annotations)
  },
}
