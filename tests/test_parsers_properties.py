"""Property-based tests (Hypothesis) for every pure parser: whatever the text, no exception
but the documented parse error; and what the kernel (or our formatter) writes, read back.

The parsers are imported by name from where they live today; if one moves (the lead is
moving mountinfo, the process table and owners into new modules), only these imports change.
"""
import math
import os
import re
import string
from dataclasses import astuple

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from exporter.check.findings import human, quantities
from exporter.host.cgroupfs import STAT_KEYS, V1_UNLIMITED, parse_flat_keyed, parse_limit
from exporter.collectors.host_memory import parse_meminfo
from exporter.collectors.sysv import parse_sysvipc_shm
from exporter.config import parse_duration, parse_size
from exporter.inventory.maps import dev_token, parse_maps
from exporter.exposition.metrics import MAX_LABEL_CHARS, clean_label as clean
from exporter.host.mountinfo import MountEntry, parse_mountinfo
from exporter.host.proctable import parse_proc_cgroup, parse_stat
from exporter.model.classes import CLASS_NAMES, CLASSES, classify

# database=None: Hypothesis would otherwise keep its examples in .hypothesis/ in the
# checkout. Under mutmut (MUTANT_UNDER_TEST set) each mutant reruns these: fewer examples.
settings.register_profile("shmwatch", max_examples=150, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("mutmut", max_examples=30, deadline=None, database=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("mutmut" if os.environ.get("MUTANT_UNDER_TEST") else "shmwatch")

# Any text a hostile or broken /proc file could hand us (lone surrogates: what
# surrogateescape makes of bytes that are not UTF-8).
any_text = st.text(st.characters(codec=None, blacklist_categories=()), max_size=400)
ints = st.integers(min_value=0, max_value=(1 << 63) - 1)

# --- mountinfo -------------------------------------------------------------------------

# Path characters: anything but NUL and '/', which names cannot hold; the kernel writes
# space, tab, newline and backslash as \ooo octal and everything else raw.
path_char = st.characters(blacklist_characters="\0/", blacklist_categories=("Cs",))
path_component = st.text(path_char, min_size=1, max_size=12)
paths = st.lists(path_component, min_size=0, max_size=4).map(lambda parts: "/" + "/".join(parts))
token = st.text(string.ascii_letters + string.digits + "_.=:,", min_size=1, max_size=16)


def mangle(text):
    """The kernel's mangle() for mountinfo: show_mountinfo's " \\t\\n\\\\" set."""
    return "".join("\\%03o" % ord(c) if c in " \t\n\\" else c for c in text)


mount_entries = st.builds(
    lambda mid, parent, major, minor, root, point, opts, optional, fstype, source, super_opts: (
        MountEntry(point, fstype, source, f"{opts},{super_opts}", f"{major}:{minor}", root),
        " ".join([str(mid), str(parent), f"{major}:{minor}", mangle(root), mangle(point), opts, *optional, "-",
                  fstype, mangle(source), super_opts])),
    st.integers(1, 10 ** 6), st.integers(0, 10 ** 6), st.integers(0, 4095), st.integers(0, 2 ** 20), paths, paths,
    token, st.lists(st.sampled_from(["shared:1", "master:7", "propagate_from:3", "unbindable"]), max_size=3),
    st.sampled_from(["tmpfs", "ext4", "overlay", "fuse.sshfs"]), st.one_of(st.just("none"), paths), token)


@given(st.lists(mount_entries, max_size=6))
@example([(MountEntry("/mnt/a\rb", "tmpfs", "shm", "rw,rw", "0:1"), "1 1 0:1 / /mnt/a\rb rw - tmpfs shm rw")])
@example([(MountEntry("/mnt/disk123 ", "tmpfs", "a\\", "rw,", "0:1"), "1 1 0:1 / /mnt/disk123\\040 rw - tmpfs a\\134")])
def test_mountinfo_round_trip(entries):
    text = "\n".join(line for _, line in entries) + "\n"
    assert parse_mountinfo(text) == [entry for entry, _ in entries]


@given(st.lists(mount_entries, max_size=4), any_text)
def test_mountinfo_malformed_lines_are_skipped_not_fatal(entries, garbage):
    good = [line for _, line in entries]
    text = "\n".join(good[:1] + [garbage.replace("\n", " ")] + good[1:])
    got = parse_mountinfo(text)
    # The good lines all come back; the garbage line, if it parses at all, is one more.
    assert len(got) in (len(good), len(good) + 1)
    assert [e for e in got if e in [x for x, _ in entries]] == [x for x, _ in entries]


@given(any_text)
def test_mountinfo_any_text(text):
    for entry in parse_mountinfo(text):
        assert isinstance(entry.mount_point, str)


# --- maps ------------------------------------------------------------------------------

# maps escapes only "\n" in a path (seq_file_path(…, "\n")) as \012.
map_paths = st.tuples(paths, st.booleans()).map(
    lambda p: p[0].replace("\n", "\\012") + (" (deleted)" if p[1] else ""))
# A small device space, so that watched and unwatched lines of major 0 (tmpfs) and of real
# disks interleave: the scanner's skip-ahead over unwatched " 00:" tokens is exercised.
devs = st.tuples(st.sampled_from([0, 0, 0x08, 0xfd, 0x103]), st.integers(0, 3))
maps_lines = st.tuples(st.integers(0, 1 << 46), st.integers(1, 1 << 30), st.sampled_from(["rw-s", "r--s", "rw-p"]),
                       st.integers(0, 1 << 40), devs, st.integers(1, 1 << 40), map_paths)


def maps_line(start, length, perms, offset, dev, inode, path):
    head = "%08x-%08x %s %08x %02x:%02x %d " % (start, start + length, perms, offset, dev[0], dev[1], inode)
    return head + " " * max(0, 73 - len(head)) + path


@given(st.lists(maps_lines, max_size=8), st.sets(devs, max_size=3), st.booleans())
@example([(0x7f0000000000, 4096, "rw-s", 0, (0xfd, 1), 7, "/tmp/x 00:1a y (deleted)")], {(0, 0x1a)}, True)
@example([(0x7f0000000000, 4096, "rw-s", 0, (0, 1), 7, "/tmp/x 00:1a y")], {(0, 0x1a)}, True)
@example([(0x7f0000000000, 4096, "rw-s", 0, (0, 1), 7, "/a"), (0x7f0000001000, 4096, "rw-s", 0, (0, 2), 8, "/b"),
          (0x7f0000002000, 4096, "rw-s", 0, (0, 1), 9, "/c"), (0x7f0000003000, 4096, "rw-s", 0, (0, 2), 10, "/d"),
          (0x7f0000004000, 4096, "rw-s", 0, (0xfd, 2), 11, "/e")], {(0, 2), (0xfd, 2)}, False)
def test_maps_finds_exactly_the_watched_lines(lines, watched, final_newline):
    tokens = {" %02x:%02x " % d: (d[0] << 8) | d[1] for d in watched}
    text = "\n".join(maps_line(*line) for line in lines) + ("\n" if final_newline else "")
    want = [((d[0] << 8) | d[1], inode, path, offset + length, f"{start:x}-{start + length:x}")
            for start, length, _, offset, d, inode, path in lines if d in watched]
    assert sorted(astuple(line) for line in parse_maps(text, tokens)) == sorted(want)


@given(any_text, st.sets(devs, max_size=3))
def test_maps_any_text(text, watched):
    for line in parse_maps(text, {" %02x:%02x " % d: d[1] for d in watched}):
        assert line.extent >= 0 and "-" in line.map_range


def test_dev_token_matches_maps():
    assert dev_token(os.makedev(0, 0x1a)) == " 00:1a "
    assert dev_token(os.makedev(0x103, 0x1ff)) == " 103:1ff "


# --- /proc/<pid>/stat ------------------------------------------------------------------

comms = st.text(st.characters(blacklist_characters="\0\n", blacklist_categories=("Cs",)), max_size=15)


@given(st.integers(1, 1 << 22), comms, st.sampled_from("RSDZTtXI"), st.integers(0, 1 << 32), st.integers(0, 1 << 62))
def test_stat_round_trip(pid, comm, state, flags, start):
    fields = ["1", "1", "1", "0", "-1", str(flags)] + ["0"] * 12 + [str(start)] + ["0"] * 30
    stat = parse_stat(f"{pid} ({comm}) {state} " + " ".join(fields) + "\n")
    assert (stat.comm, stat.flags, stat.start_time, stat.ppid) == (comm, flags, start, 1)


@given(any_text)
def test_stat_any_text_raises_only_value_or_index_error(text):
    # ProcScanner.identity catches exactly these.
    try:
        parse_stat(text)
    except (ValueError, IndexError):
        pass


# --- cgroup ----------------------------------------------------------------------------

# cgroup names can be anything but '/' and NUL; the line separators splitlines() knows
# besides "\n" are left out here (no kubelet or systemd makes them; see the report).
cgroup_path = st.lists(st.text(st.characters(blacklist_characters="\0/\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029",
                                             blacklist_categories=("Cs",)), min_size=1, max_size=10),
                       max_size=4).map(lambda p: "/" + "/".join(p))
controllers = st.lists(st.sampled_from(["memory", "cpu", "cpuacct", "blkio", "pids", "name=systemd", "devices"]),
                       min_size=1, max_size=3, unique=True)


@given(st.lists(st.tuples(controllers, cgroup_path), max_size=5), st.one_of(st.none(), cgroup_path))
def test_proc_cgroup_round_trip(v1, v2):
    lines, want = [], {}
    for i, (ctrls, path) in enumerate(v1, start=1):
        lines.append(f"{i}:{','.join(ctrls)}:{path}")
        want.update({c: path for c in ctrls})
    if v2 is not None:
        lines.append(f"0::{v2}")
        want[""] = v2
    assert parse_proc_cgroup("\n".join(lines) + "\n") == want


@given(any_text)
def test_proc_cgroup_any_text(text):
    assert all(isinstance(v, str) for v in parse_proc_cgroup(text).values())


stat_keys = st.text(string.ascii_lowercase + "_", min_size=1, max_size=24)


@given(st.dictionaries(stat_keys, st.integers(-(1 << 63), (1 << 64) - 1), max_size=20))
def test_flat_keyed_round_trip(values):
    assert parse_flat_keyed("".join(f"{k} {v}\n" for k, v in values.items())) == values


@given(any_text)
def test_flat_keyed_any_text(text):
    assert all(isinstance(v, int) for v in parse_flat_keyed(text).values())


stat_lines = st.tuples(st.sampled_from(sorted(STAT_KEYS) + ["anon", "file"]), st.text("0123456789 x-\t", max_size=8))


@given(st.one_of(any_text, st.lists(stat_lines).map(lambda kv: "\n".join(f"{k} {v}" for k, v in kv))))
def test_flat_keyed_of_some_keys_is_the_whole_parse_cut_down(text):
    """memory.stat parsed for the keys read_files takes: exactly those of the whole parse."""
    whole = parse_flat_keyed(text)
    assert parse_flat_keyed(text, STAT_KEYS) == {k: v for k, v in whole.items() if k in STAT_KEYS}


@given(st.integers(0, (1 << 64) - 1), st.sampled_from(["", "\n", " \n"]))
def test_limit_round_trip(limit, tail):
    assert parse_limit(f"{limit}{tail}") == (None if limit >= V1_UNLIMITED else limit)
    assert parse_limit(f"max{tail}") is None


limit_texts = st.one_of(
    any_text,
    st.builds(lambda n, pad, tail: f"{pad}{n}{tail}", st.one_of(st.integers(-2, (1 << 64)),
                                                             st.integers(V1_UNLIMITED - 2, V1_UNLIMITED + 2)),
              st.sampled_from(["", " ", "\t"]), st.sampled_from(["", "\n", "x", " 5"])),
)


@given(limit_texts)
@example("-1\n")
@example(f" {V1_UNLIMITED - 1}\n")
@example(f"{V1_UNLIMITED}")
@example("max\n")
@example("0")
def test_limit_is_the_number_in_the_file_or_none_only_for_unlimited(text):
    """Anything else than one number (or "max") is a ValueError, never a guessed limit; None
    only for "max" and v1's unlimited and above; any other number is the limit itself."""
    try:
        result = parse_limit(text)
    except ValueError:
        return
    written = text.strip()
    if result is None:
        assert written == "max" or int(written) >= V1_UNLIMITED
    else:
        assert result == int(written) < V1_UNLIMITED


# --- meminfo ---------------------------------------------------------------------------

meminfo_keys = st.text(string.ascii_letters + string.digits + "_()", min_size=1, max_size=20)


@given(st.dictionaries(meminfo_keys, st.tuples(st.integers(0, 1 << 50), st.booleans()), max_size=40))
def test_meminfo_round_trip(values):
    text = "".join(f"{k + ':':<16}{v:>8}{' kB' if kb else ''}\n" for k, (v, kb) in values.items())
    assert parse_meminfo(text) == {k: v * 1024 if kb else v for k, (v, kb) in values.items()}


@given(any_text)
def test_meminfo_any_text(text):
    assert all(isinstance(v, int) for v in parse_meminfo(text).values())


# --- /proc/sysvipc/shm -----------------------------------------------------------------

SYSV_COLUMNS = ["key", "shmid", "perms", "size", "cpid", "lpid", "nattch", "uid", "gid", "cuid", "cgid", "atime",
                "dtime", "ctime", "rss", "swap"]
sysv_rows = st.lists(st.fixed_dictionaries({c: st.integers(0 if c != "key" else -(1 << 31), 1 << 40)
                                            for c in SYSV_COLUMNS}), max_size=6)


@given(st.permutations(SYSV_COLUMNS), sysv_rows, st.booleans())
def test_sysvipc_round_trip_in_any_column_order(columns, rows, with_rss):
    columns = [c for c in columns if with_rss or c not in ("rss", "cpid")]
    text = " ".join(f"{c:>10}" for c in columns) + "\n" + "".join(
        " ".join(f"{row[c]:>10}" for c in columns) + "\n" for row in rows)
    got = [(s.key, s.shmid, s.size_bytes, s.nattch, s.cpid, s.lpid, s.rss_bytes) for s in parse_sysvipc_shm(text)]
    assert got == [(r["key"], r["shmid"], r["size"], r["nattch"], r["cpid"] if with_rss else 0, r["lpid"],
                    r["rss"] if with_rss else 0) for r in rows]


@given(any_text)
def test_sysvipc_any_text_raises_only_value_error(text):
    try:
        parse_sysvipc_shm(text)
    except ValueError as err:
        assert "unexpected header" in str(err)


# --- sizes and durations ---------------------------------------------------------------

BINARY = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50, "Ei": 1 << 60}
DECIMAL = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30,  # docker's --shm-size: lower case is binary
           "K": 10 ** 3, "M": 10 ** 6, "G": 10 ** 9, "T": 10 ** 12, "P": 10 ** 15, "E": 10 ** 18}


@given(st.integers(0, 1 << 20), st.sampled_from(sorted({**BINARY, **DECIMAL, "": 1})), st.sampled_from(["", "B", "b"]))
def test_size_kubernetes_and_docker_forms(number, suffix, byte):
    factor = {**BINARY, **DECIMAL, "": 1}[suffix]
    assert parse_size(f"{number}{suffix}{byte if suffix else ''}") == number * factor


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


@given(any_text)
@example("9" * 400)
@example("9" * 400 + "Gi")
def test_size_any_text_raises_only_value_error(text):
    try:
        result = parse_size(text)
    except ValueError:
        return
    assert isinstance(result, int) and result >= 0


GO_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600}


@given(st.integers(1, 10 ** 6), st.sampled_from(sorted(GO_UNITS) + [""]))
def test_duration_single_unit_forms(number, unit):
    assert parse_duration(f"{number}{unit}") == pytest.approx(number * GO_UNITS.get(unit, 1))


@given(st.integers(0, 48), st.integers(0, 59), st.integers(0, 59))
def test_duration_go_compound_forms_parse_or_are_refused(h, m, s):
    # Go's time.ParseDuration (Prometheus' flags) also takes "1h30m"; shmwatch takes one
    # unit per value. A compound form must not be misread: the right value or a ValueError.
    text = f"{h}h{m}m{s}s"
    try:
        got = parse_duration(text)
    except ValueError as err:
        assert "invalid duration" in str(err)
        return
    assert got == h * 3600 + m * 60 + s


@given(any_text)
@example("9" * 400)
@example("0")
@example("0.0ms")
def test_duration_any_text_raises_only_value_error(text):
    try:
        result = parse_duration(text)
    except ValueError:
        return
    assert math.isfinite(result) and result > 0


# --- the segment class table and label cleaning ----------------------------------------

@given(st.text(max_size=40))
def test_classify_is_total_and_ignores_deleted(name):
    cls = classify(name)
    assert cls in CLASS_NAMES
    assert classify(name + " (deleted)") == cls


# One example name per row; a longer prefix of an earlier row may win (psm_shm. -> mpi).
ROW_PREFIX = [(r.cls, re.sub(r"(\\\.)?\.\*$", "", r.pattern).replace("\\.", "."), r.pattern) for r in CLASSES]


@pytest.mark.parametrize("cls,prefix,pattern", ROW_PREFIX, ids=[p for _, p, _ in ROW_PREFIX])
@given(suffix=st.text(max_size=20))
def test_every_row_classifies_its_names(cls, prefix, pattern, suffix):
    name = prefix + ("." if pattern.endswith("\\..*") else "") + suffix
    first = next(r.cls for r in CLASSES if re.fullmatch(r.pattern, name, re.S))
    assert classify(name) == first
    assert first == cls or cls == "python_shm"  # only psm_* has more specific rows before it


# What clean() is given: names from os.scandir or /proc, str with undecodable bytes as
# surrogateescape's lone surrogates (U+DC80..U+DCFF, never another lone surrogate), or bytes.
names = st.one_of(st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
                  st.binary(max_size=300).map(lambda b: b.decode("utf-8", "surrogateescape")))


@given(st.one_of(names, st.binary(max_size=400)), st.integers(2, 300))
def test_clean_labels(value, limit):
    out = clean(value, limit)
    assert len(out) <= limit
    assert not re.search(r"[\x00-\x1f\x7f-\x9f]", out)
    out.encode("utf-8")  # valid UTF-8: no lone surrogates left
    assert clean(out, limit) == out
    if isinstance(value, str) and value.isprintable() and len(value) <= limit and value == clean(value, limit):
        assert out == value


def test_clean_default_limit():
    assert len(clean("x" * 1000)) == MAX_LABEL_CHARS
