"""exporter/check/names.py: `shown` (a name as check prints it), `shell` (a command to paste,
checked by bash itself) and `leaked_names` (every name of a leaked file, by lstat and a bounded
walk that never follows a symlink)."""
import os
import time
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from exporter.check.names import Names, leaked_names, printable, shell, shown
from exporter.host.paths import Paths
from exporter.model.types import Segment
from tests.behaviour.hostile_names import FOREIGN_NAMES, leaked_names as corpus, pasted, unescape

NAMES = st.binary(min_size=1, max_size=64).filter(lambda b: b"\0" not in b)


def test_shown_escapes_what_a_terminal_obeys_and_nothing_else():
    assert shown("nccl-a;$(id) *") == "nccl-a;$(id) *"  # printable: as it is (the advice quotes it)
    assert shown("\x1b[2J\x07\r\n\t\x7f") == "\\x1b[2J\\x07\\x0d\\x0a\\x09\\x7f"
    assert shown("\u009b\u202e\u2028\ufeff") == "\\u009b\\u202e\\u2028\\ufeff"
    assert shown(os.fsdecode(b"psm_\xff\xc3")) == "psm_\\xff\\xc3"  # not UTF-8: the bytes
    assert shown("a\\x1b") == "a\\\\x1b"  # a backslash doubled: never passes for an escape
    assert shown("é \U0001f600") == "é \U0001f600"
    assert printable("a\\x1b\x1b") == "a\\x1b\\x1b"  # the guard leaves backslashes alone


@given(NAMES)
def test_shown_is_printable_and_reads_back_to_the_bytes(name):
    text = shown(os.fsdecode(name))
    assert text.isprintable()
    assert unescape(text) == name


def test_shell_quotes_each_argument_and_only_when_needed():
    assert shell("rm", "--", "/dev/shm/nccl-a") == "rm -- /dev/shm/nccl-a"
    assert shell("/m/a;id", "/m/x *", "") == "'/m/a;id' '/m/x *' ''"
    assert shell("it's") == "'it'\"'\"'s'"
    assert shell("a\nb", "\x1b'\\!") == "$'a\\x0ab' $'\\x1b\\'\\\\\\x21'"
    assert shell(os.fsdecode(b"\xff")) == "$'\\xff'"
    assert shell("\u202e") == "$'\\xe2\\x80\\xae'"  # every byte of a character not printable
    assert shell("/m/é") == "$'/m/\\xc3\\xa9'"  # not ASCII: a terminal that cannot show it pastes it exact


def test_bash_reads_every_corpus_name_back(tmp_path):
    names = corpus() + FOREIGN_NAMES + [bytes([b]) for b in range(1, 256) if b != ord("/")]
    command = shell("rm", "--", *map(os.fsdecode, names)).encode()
    assert command.isascii() and command.decode().isprintable()  # exact in any terminal
    assert pasted(command, str(tmp_path)) == [b"rm", b"--", *names]


@settings(max_examples=50, deadline=None)
@given(st.lists(NAMES, min_size=1, max_size=20))
def test_bash_reads_any_name_back(tmp_path_factory, names):
    command = shell(*map(os.fsdecode, names))
    assert command.isascii() and command.isprintable()  # one line, exact in any terminal
    assert pasted(b"rm " + command.encode(), str(tmp_path_factory.getbasetemp())) == [b"rm", *names]


def listed(root, name):
    """The segment the inventory lists for file `name` below `root` (its inode now)."""
    st = os.lstat(os.path.join(root, name))
    return Segment(name, "nccl", "orphan", 0, 0, 0.0, (), (st.st_dev, st.st_ino))


def names_of(root, segments, deadline=30.0):
    """leaked_names for `segments` of the mount `root`, with `deadline` seconds to walk it."""
    model = SimpleNamespace(mounts=[SimpleNamespace(mount=str(root), summary=SimpleNamespace(leaked=segments))])
    return leaked_names(model, Paths(), time.monotonic() + deadline)


def test_every_name_of_a_file_is_found_below_the_mount_and_nowhere_else(tmp_path):
    root, outside = tmp_path / "mount", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    outside.mkdir()
    (root / "nccl-1").write_bytes(b"x")
    for link in ("a/nccl-2", "a/b/nccl-3", "../outside/nccl-4"):
        os.link(root / "nccl-1", root / link)
    (root / "nccl-alone").write_bytes(b"x")
    os.symlink(outside, root / "a" / "to-outside")  # not followed: nccl-4 is not found
    one, alone = listed(root, "nccl-1"), listed(root, "nccl-alone")
    assert names_of(root, [one, alone]) == {one.key: Names(("a/b/nccl-3", "a/nccl-2", "nccl-1"), 4),
                                            alone.key: Names(("nccl-alone",), 1)}  # one name: no walk
    (root / "new").write_bytes(b"a new file, not the one listed")
    os.replace(root / "new", root / "nccl-alone")  # made before the old one is gone: another inode
    assert names_of(root, [alone]) == {alone.key: Names((), 0)}  # so it is not advised away


def test_a_walk_past_its_deadline_finds_fewer_names_than_the_file_has(tmp_path):
    (tmp_path / "nccl-1").write_bytes(b"x")
    os.link(tmp_path / "nccl-1", tmp_path / "nccl-2")
    seg = listed(tmp_path, "nccl-1")
    late = names_of(tmp_path, [seg], deadline=-1)
    assert late[seg.key].links == 2 and len(late[seg.key].found) < 2  # so no rm is advised
