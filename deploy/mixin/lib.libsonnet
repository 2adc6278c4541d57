// Small helpers shared by the alerts, rules and dashboard (no third-party jsonnet).
{
  // A number as PromQL text: jsonnet's own formatting writes 0.8 as 0.80000000000000004.
  num(x):: if std.floor(x) == x then '%d' % x else '%g' % x,
  // A ||| text block as one line (what YAML's folded `>-` made of the same text).
  oneLine(text):: std.join(' ', std.split(std.rstripChars(text, '\n'), '\n')),
}
