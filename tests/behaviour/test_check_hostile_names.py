"""`shmwatch check` when the names are the attack (tests/behaviour/hostile_names.py): files left
by a process that exited in real tmpfs mounts (some at hostile paths themselves), a live
segment with a hostile name beside them, hard links in and out of a mount, a log with hostile
quoted parts, and the real `shmwatch check`, text and JSON.

What must hold: no control character reaches the terminal (text: valid UTF-8, every character
printable but the line ends; JSON: escaped, its findings' texts printable, its facts the names
as they are); every name shown can be read back to its bytes; and each `rm` advised, parsed
by bash itself and then pasted into bash for real, removes exactly the orphans: no more, no
less, nothing outside their mount, nothing run but `rm`."""

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from typing import Iterator, List, Optional, Tuple

import pytest

from tests.behaviour.hostile_names import FOREIGN_NAMES, LOG_LINES, leaked_names, pasted, unescape
from tests.conftest import REPO, Peer, needs_root

NAMED = 5  # check names at most this many leaked files per mount (findings.MAX_NAMED)
RM = b"once no server can attach to them: "
COMM = b"\x1b]0;pwn\x07\r\xff$(id)"  # a process's name: 15 bytes at most
# Mount points: the mount's path is part of every path advised.
MOUNT_NAMES = [b"m $(touch PWNED) 'q';id", b"m-\x1b[2J\x07", "m-\u202e-\U0001f600".encode(), b"m*?[x]",
               b"m-\\x1b-\\"]


def check(*args: str) -> Tuple[bytes, dict]:
    """The real `shmwatch check ARGS`: its text (bytes) and JSON, whose every byte is printable
    ASCII or a line end (JSON's escapes), parsed."""
    def run(*extra: str) -> bytes:
        argv = [sys.executable, "-m", "exporter", "check", "--no-collector.gpu", *args, *extra]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120)
        assert done.returncode in (0, 1), done.stderr.decode(errors="replace")[-3000:]
        assert not done.stderr, done.stderr.decode(errors="replace")[-3000:]
        return done.stdout
    raw = run("--output=json")
    assert all(0x20 <= b < 0x7F or b == 0x0A for b in raw), raw
    return run(), json.loads(raw)


def leave(paths: List[bytes], size: int = 4096) -> None:
    """A process creates each file (`size` bytes allocated) and exits: what it leaves is leaked."""
    code = ("import os, sys\nfor p in map(os.fsencode, sys.argv[2:]):\n"
            "    fd = os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)\n"
            "    os.posix_fallocate(fd, 0, int(sys.argv[1]))\n    os.close(fd)\n")
    subprocess.run([sys.executable, "-c", code, str(size), *map(os.fsdecode, paths)], check=True)


@contextlib.contextmanager
def tmpfs_mounts(names: List[bytes], size: str = "2m") -> Iterator[List[bytes]]:
    """A real tmpfs at each of `names` below a new directory; unmounted (lazily) at the end."""
    parent = tempfile.mkdtemp(prefix="shmwatch-names-").encode()
    mounts: List[bytes] = []
    try:
        for name in names:
            path = os.path.join(parent, name)
            os.mkdir(path)
            subprocess.run([b"mount", b"-t", b"tmpfs", b"-o", f"size={size}".encode(), b"tmpfs", path], check=True)
            mounts.append(path)
        yield mounts
    finally:
        for path in mounts:
            subprocess.run([b"umount", b"-l", path], check=False)
        subprocess.run(["rm", "-rf", "--", parent], check=False)


def mount_flags(mounts: List[bytes]) -> List[str]:
    return [f"--shm.mount={os.fsdecode(m)}" for m in mounts]


def assert_terminal_safe(text: bytes) -> str:
    """Valid UTF-8, every character printable but the line ends: nothing a terminal obeys."""
    decoded = text.decode("utf-8")  # strict: a byte that is not UTF-8 is a failure
    bad = {c for line in decoded.split("\n") for c in line if not c.isprintable()}
    assert not bad, f"raw characters in check's text: {sorted(map(hex, map(ord, bad)))}"
    return decoded


def assert_json_safe(raw: dict) -> None:
    """The findings' texts hold no control character once decoded (what `jq -r` prints)."""
    for f in raw["findings"]:
        for key in ("subject", "message", "remedy"):
            bad = {c for c in f[key] if not c.isprintable()}
            assert not bad, f"{key} of {f['message'][:80]!r}: {sorted(map(hex, map(ord, bad)))}"


def command(remedy: bytes) -> Optional[bytes]:
    """The `rm` command at the end of a removal's remedy; after its notes, if any (these tests
    put no '): rm' in a name a note shows)."""
    if remedy.startswith(RM):
        return remedy[len(RM):]
    if remedy.startswith(RM[:-2] + b" (") and b"): rm " in remedy:
        return remedy[remedy.index(b"): rm ") + 3:]
    return None


def text_commands(text: str) -> List[bytes]:
    """The `rm` commands of the text output, one per remedy line ("-> ...")."""
    lines = [line.strip().removeprefix("-> ").encode() for line in text.split("\n")]
    return [c for c in map(command, lines) if c is not None]


def json_commands(doc: dict) -> List[bytes]:
    return [c for c in (command(f["remedy"].encode()) for f in doc["findings"]) if c is not None]


def advised(commands: List[bytes], cwd: str) -> List[bytes]:
    """Every path the commands pass to rm, as bash parses them; each is `rm -- PATHS`."""
    paths: List[bytes] = []
    for command in commands:
        argv = pasted(command, cwd)
        assert argv[:2] == [b"rm", b"--"], (command, argv)
        paths += argv[2:]
    return paths


HOLDER = """import ctypes, os, sys
fd = os.memfd_create("x")
os.posix_fallocate(fd, 0, 64 << 20)  # above the machine's own memfds: among the 5 named
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(bytes.fromhex(sys.argv[1])), 0, 0, 0)  # PR_SET_NAME
print("ready", flush=True)
sys.stdin.read()
"""


@contextlib.contextmanager
def memfd_holder(comm: bytes) -> Iterator[int]:
    """A process named `comm` (its comm: 15 bytes at most) holding a 64 MiB memfd: its pid."""
    with subprocess.Popen([sys.executable, "-c", HOLDER, comm.hex()], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE) as proc:
        assert proc.stdout.readline() == b"ready\n"
        try:
            yield proc.pid
        finally:
            proc.stdin.close()
            proc.wait(10)


@pytest.fixture
def decoy(tmp_path) -> Iterator[str]:
    """The directory a user pastes into: files a glob would match, a target a `--` would hit."""
    for name in ("precious", "-rf", "x", "a"):
        (tmp_path / name).write_text("keep")
    yield str(tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["-rf", "a", "precious", "x"], "the paste touched the cwd"


@needs_root
def test_hostile_names_are_shown_escaped_and_advised_exactly(decoy):
    names = leaked_names()
    per_mount = [names[i:i + NAMED] for i in range(0, len(names), NAMED)]  # all of them named
    labels = MOUNT_NAMES + [b"m%d" % i for i in range(len(per_mount) - len(MOUNT_NAMES))]
    with tmpfs_mounts(labels) as mounts:
        orphans = {os.path.join(m, n) for m, batch in zip(mounts, per_mount) for n in batch}
        leave(sorted(orphans))
        foreign = [os.path.join(mounts[0], n) for n in FOREIGN_NAMES]
        leave(foreign)
        live_name = "nccl-live;$(touch PWNED) \x1b[2J"
        with Peer(os.fsdecode(mounts[1]), "mapped", live_name, "4096"), memfd_holder(COMM) as holder:
            live = os.path.join(mounts[1], os.fsencode(live_name))
            text, doc = check(*mount_flags(mounts), "--recommend")
            checked(text, doc, mounts, per_mount, orphans, foreign, decoy)
            assert COMM + b"[%d]" % holder in unescape(text.decode())  # check names memfd holders
            assert "\nRECOMMENDATIONS (" in text.decode()  # the guard keeps line ends
            recommended = [unescape(line) for line in text.decode().split("\n") if ": observed peak " in line]
            assert sorted(line.split(b": observed peak ")[0] for line in recommended) == sorted(mounts)
            for command in text_commands(text.decode()):  # pasted into bash for real
                subprocess.run([b"bash", b"-c", command], cwd=decoy, check=True, env=dict(os.environ, HOME=decoy))
            left = {os.path.join(m, n) for m in mounts for n in os.listdir(m)}
            assert left == set(foreign) | {live}, left  # the orphans are gone, nothing else is
    assert not os.path.exists(os.path.join(decoy, "PWNED"))


def checked(text, doc, mounts, per_mount, orphans, foreign, decoy) -> None:
    """Both outputs of a check of the corpus: safe, readable back, and advising the orphans."""
    shown = assert_terminal_safe(text)
    assert_json_safe(doc)
    # Every orphan is named in its mount's finding, readable back to its bytes.
    leaked = [f for f in doc["findings"] if "leaked segment(s)" in f["message"]]
    assert len(leaked) == len(mounts), [f["message"][:100] for f in leaked]
    for finding in leaked:
        mount = next(m for m in mounts if unescape(finding["subject"]) == m)
        message = unescape(finding["message"])
        assert all(os.path.join(mount, n) in message for n in per_mount[mounts.index(mount)])
        assert message in unescape(shown)  # the text shows what the JSON does
    for path in foreign:
        assert path in unescape(shown)
    # The JSON's facts keep the names as they are.
    facts = {os.path.join(os.fsencode(s["mount"]), os.fsencode(o["name"])) for s in doc["shm"] for o in s["orphans"]}
    assert facts == orphans | set(foreign)
    # The advice, parsed by bash: exactly the orphans, each once.
    for commands in (text_commands(shown), json_commands(doc)):
        paths = advised(commands, decoy)
        assert sorted(paths) == sorted(orphans), set(paths) ^ orphans


def statvfs_used(mount: bytes) -> int:
    st = os.statvfs(mount)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@needs_root
def test_a_file_with_50_names_is_removed_by_all_of_them(decoy):
    MiB = 1 << 20
    with tmpfs_mounts([b"links"], size="8m") as [mount]:
        first = os.path.join(mount, b"nccl-hl;$(id)")
        leave([first], MiB)
        os.mkdir(os.path.join(mount, b"sub \x1b[2J"))
        others = [os.path.join(mount, b"nccl-hl-%d \x07" % i) for i in range(30)]
        others += [os.path.join(mount, b"sub \x1b[2J", b"psm_hl-%d'" % i) for i in range(19)]
        for path in others:
            os.link(first, path)
        assert os.lstat(first).st_nlink == 50
        text, doc = check(*mount_flags([mount]))
        shown = assert_terminal_safe(text)
        assert "has 50 names, all removed" in shown, shown
        for commands in (text_commands(shown), json_commands(doc)):
            assert len(commands) == 1, commands
            assert sorted(advised(commands, decoy)) == sorted([first, *others])
        before = statvfs_used(mount)
        subprocess.run([b"bash", b"-c", text_commands(shown)[0]], cwd=decoy, check=True)
        assert before - statvfs_used(mount) >= MiB, "pasting the advice freed nothing"
        assert os.listdir(mount) == [b"sub \x1b[2J"]


@needs_root
def test_a_file_with_a_name_outside_the_mount_gets_no_rm(decoy):
    """The watched mount is a bind of a tmpfs's sub-directory; the leaked file has a second
    name in the tmpfs outside it: removing the name we see frees nothing, so no `rm`. A file
    also named as a class shmwatch never removes (`lock`) is not advised away either."""
    with tmpfs_mounts([b"whole"]) as [whole]:
        inner, seen = os.path.join(whole, b"inner"), os.path.join(os.path.dirname(whole), b"seen")
        os.mkdir(inner)
        os.mkdir(seen)
        subprocess.run([b"mount", b"--bind", inner, seen], check=True)
        try:
            leave([os.path.join(inner, b"nccl-out")])
            os.link(os.path.join(inner, b"nccl-out"), os.path.join(whole, b"nccl-elsewhere"))
            leave([os.path.join(inner, b"nccl-locked")])
            os.link(os.path.join(inner, b"nccl-locked"), os.path.join(inner, b"lock"))
            text, doc = check(*mount_flags([seen]))
        finally:
            subprocess.run([b"umount", b"-l", seen], check=False)
    shown = assert_terminal_safe(text)
    assert f"{os.fsdecode(seen)}/nccl-out has 2 names, 1 not found below {os.fsdecode(seen)}" in shown, shown
    assert "removing the others frees nothing" in shown
    remedies = " ".join(f["remedy"] for f in doc["findings"])
    assert "rm --" not in remedies and "rm --" not in shown, remedies


@needs_root
def test_hostile_quoted_parts_of_a_log_are_shown_escaped(tmp_path):
    log = tmp_path / "server \x1b[2J.log"
    log.write_bytes(b"\n".join(LOG_LINES) + b"\n")
    text, doc = check(f"--log={log}", "--no-collector.segments")
    shown = assert_terminal_safe(text)
    assert_json_safe(doc)
    said = [unescape(f["message"]) for f in doc["findings"] if f["area"] == "log"]
    volume = b"dshm\x1b]0;pwned\x07$(touch PWNED)"
    assert any(volume in s and b"1Gi\x1b[2J\r" in s for s in said), said  # the explanation's {volume}
    assert any(b"nccl-\x1b[31m\xff`id`" in s for s in said), said  # the segment, its invalid byte kept
    assert any(b"\x1b[2J\x1b[H\x07\r" in s and "\u202e".encode() in s for s in said), said  # Seen: ...
    assert all(unescape(f["subject"]).startswith(b"server \x1b[2J.log") for f in doc["findings"]
               if f["area"] == "log")
    assert "server \\x1b[2J.log" in shown


@needs_root
def test_a_name_the_terminal_cannot_encode_is_escaped_not_a_crash():
    """A latin-1 terminal and a leaked file named in CJK: check printed a traceback, exit 70."""
    with tmpfs_mounts([b"cjk"]) as [mount]:
        leave([os.path.join(mount, "nccl-中".encode())])
        argv = [sys.executable, "-m", "exporter", "check", "--no-collector.gpu", *mount_flags([mount])]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, timeout=120,
                              env=dict(os.environ, PYTHONIOENCODING="latin-1"))
    assert done.returncode == 1 and not done.stderr, done.stderr.decode(errors="replace")[-2000:]
    assert b"nccl-\\u4e2d" in done.stdout  # shown; the advice, ASCII, exact in any terminal:
    assert b"rm -- $'" + mount + b"/nccl-\\xe4\\xb8\\xad'" in done.stdout, done.stdout.decode("latin-1")
