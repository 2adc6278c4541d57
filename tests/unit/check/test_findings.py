"""findings.render_text: the last guard before the terminal. A text that reached a finding
without names.shown (a bug) still prints no control character; what shown made is kept."""
import re

from hypothesis import given
from hypothesis import strategies as st

from exporter.check.findings import Report, human, quantities, render_text
from exporter.config import parse_size
from tests.helpers import GiB, KiB, MiB


def test_render_text_escapes_what_reached_it_raw():
    report = Report()
    report.add("warn", "shm", "/m/\x1b[2J", "leaked: /m/a\rb\u202e", "rm -- $'/m/\\x07'")
    text = render_text(report)
    assert all(line.isprintable() for line in text.split("\n"))
    assert "/m/\\x1b[2J" in text and "/m/a\\x0db\\u202e" in text
    assert "-> rm -- $'/m/\\x07'" in text  # a backslash is the escapes' own: not doubled


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


@given(st.integers(1, 1 << 50))
def test_size_round_trips_through_the_kubernetes_formatter(n):
    docker, text = quantities(n)
    assert re.fullmatch(r"\d+(Gi|Mi)", text) and docker == text[:-1].lower()
    back = parse_size(text)
    assert back == (n if n % (1 << 30) == 0 else -(-n >> 20) << 20)  # advice rounds up


@given(st.integers(1 << 10, 1 << 50))
def test_size_round_trips_through_the_human_formatter_within_rounding(n):
    text = human(n)
    unit = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}[text.split()[1]]
    assert abs(parse_size(text.replace(" ", "")) - n) <= unit // 20 + 1  # one decimal: half a tenth off at most
