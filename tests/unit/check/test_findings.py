"""findings.render_text: the last guard before the terminal. A text that reached a finding
without names.shown (a bug) still prints no control character; what shown made is kept."""
from exporter.check.findings import Report, render_text


def test_render_text_escapes_what_reached_it_raw():
    report = Report()
    report.add("warn", "shm", "/m/\x1b[2J", "leaked: /m/a\rb\u202e", "rm -- $'/m/\\x07'")
    text = render_text(report)
    assert all(line.isprintable() for line in text.split("\n"))
    assert "/m/\\x1b[2J" in text and "/m/a\\x0db\\u202e" in text
    assert "-> rm -- $'/m/\\x07'" in text  # a backslash is the escapes' own: not doubled
