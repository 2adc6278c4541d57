"""Names a workload that can write to the shm mount (or to a log) may choose, to attack whoever
reads `shmwatch check`: the terminal (control bytes, escape sequences, bidi overrides), the
shell an `rm` is pasted into (quotes, substitutions, globs, separators, a leading `-`), and
the reader (invalid UTF-8, names at the 255-byte limit). One corpus for every test of them.

Each entry is the part after an owner-class prefix, as bytes (a file name is bytes: no NUL,
no '/'); `leaked_names()` gives each a prefix of a removable class, so that an orphan of that
name gets `rm` advice."""

import re
import shutil
import subprocess
from typing import Dict, List

BASH = shutil.which("bash") or "/bin/bash"
MAX_NAME = 255  # NAME_MAX: tmpfs refuses one byte more

# Every C0 control byte but NUL, and DEL: each alone in a name.
CONTROL_BYTES: List[bytes] = [bytes([b]) + b"-x" for b in [*range(0x01, 0x20), 0x7F]]

HOSTILE: Dict[str, bytes] = {
    "clear-screen": b"\x1b[2J\x1b[H",
    "retitle-with-bel": b"\x1b]0;pwned\x07",
    "colour": b"\x1b[31mred\x1b[0m",
    "cursor-up-overwrite": b"ok\x1b[1A\x1b[2KFAKE OK",
    "carriage-return": b"x\rOK     shm     fine",
    "c1-csi-as-utf8": "\u009b2J".encode(),
    "c1-csi-raw-byte": b"\x9b2J",
    "nel-and-line-separator": "a\u0085b\u2028c\u2029d".encode(),
    "rtl-override": "\u202egpj.exe".encode(),
    "zero-width-and-bom": "a\u200bb\ufeffc".encode(),
    "single-quote": b"a'b",
    "quote-breakout": b"'$(touch PWNED)'",
    "double-quote": b'a"b',
    "command-substitution": b"$(touch PWNED)",
    "backticks": b"`touch PWNED`",
    "parameter": b"${HOME}$PATH",
    "arithmetic": b"$((1+1))",
    "ansi-c-breakout": b"$'\\x41'",
    "glob-star": b"x *",
    "glob-question": b"?",
    "glob-class": b"[a-z]",
    "brace-expansion": b"{a,b}",
    "tilde": b"~root",
    "spaces": b"a b  c ",
    "tab": b"a\tb",
    "newline": b"a\nb",
    "newline-command": b"x\nrm -rf ~\n",
    "semicolon": b"a;id",
    "pipe": b"a|id",
    "ampersand": b"a&id&",
    "and-or": b"a&&id||id",
    "redirects": b"a>PWNED<b 2>&1",
    "history": b"!!x!$",
    "comment": b"a #b",
    "backslash": b"a\\b",
    "escape-lookalike": b"\\x1b[2J",  # literal backslash-x: must not pass for ESC
    "format-braces": b"{paths}{0}%s%n",
    "dash-dash": b" -- -rf",
    "invalid-utf8-ff": b"\xff\xfe",
    "invalid-utf8-truncated": b"\xc3",
    "invalid-utf8-overlong": b"\xc0\xaf",
    "invalid-utf8-surrogate": b"\xed\xa0\x80",
    "emoji": "\U0001f600".encode(),
    "mixed": b"\x1b[2J;$(id)`id`'\"\\\xff\n*",
}

# Prefixes of classes whose orphans get `rm` advice (exporter/model/classes.py REMOVABLE).
REMOVABLE_PREFIXES = [b"nccl-", b"psm_", b"torch_", b"ucx_shm_posix_", b"vllm_offload_", b"sgl_shm_"]


def leaked_names() -> List[bytes]:
    """Every hostile entry under a removable prefix, plus names at the 255-byte limit."""
    parts = CONTROL_BYTES + list(HOSTILE.values())
    names = [REMOVABLE_PREFIXES[i % len(REMOVABLE_PREFIXES)] + p for i, p in enumerate(parts)]
    names.append(b"nccl-" + b"A" * (MAX_NAME - 5))
    names.append(b"nccl-" + b"\x1b" * (MAX_NAME - 5))  # each byte 4 characters shown
    names.append(b"nccl-" + "\u202e".encode() * ((MAX_NAME - 5) // 3))
    assert all(len(n) <= MAX_NAME and b"/" not in n and b"\0" not in n for n in names)
    assert len(set(names)) == len(names)
    return names


# Names of no removable class (no advice, only shown), a leading '-' among them: an `rm`
# that took one as an option would do something else.
FOREIGN_NAMES: List[bytes] = [b"-rf", b"--help", b"-\x1b[2J", b"--no-preserve-root x", b"lock;id"]

# Quoted parts of log lines the signatures capture (a volume, a limit, a segment).
LOG_LINES: List[bytes] = [
    b'Usage of EmptyDir volume "dshm\x1b]0;pwned\x07$(touch PWNED)" exceeds the limit "1Gi\x1b[2J\r"',
    b"NCCL WARN Error while attaching to shared memory segment /dev/shm/nccl-\x1b[31m\xff`id` (size 0)",
    b"vllm: Bus error (core dumped) \x1b[2J\x1b[H\x07\r\xc2\x9b\xe2\x80\xae",
]


def unescape(text: str) -> bytes:
    """The bytes `check` showed as `text` (docs/check.md): `\\xHH` a byte, `\\uHHHH` and
    `\\UHHHHHHHH` a character, `\\\\` a backslash; the rest as it is, in UTF-8."""
    escape = re.compile(r"\\(x[0-9a-f]{2}|u[0-9a-f]{4}|U[0-9a-f]{8}|\\)")
    out, at = bytearray(), 0
    for found in escape.finditer(text):
        out += text[at:found.start()].encode()
        code = found.group(1)
        if code == "\\":
            out += b"\\"
        elif code[0] == "x":
            out.append(int(code[1:], 16))
        else:
            out += chr(int(code[1:], 16)).encode()
        at = found.end()
    return bytes(out + text[at:].encode())


def pasted(command: bytes, cwd: str) -> List[bytes]:
    """The argv `command` runs when pasted into bash in `cwd`, as bash parses it: every
    command is shadowed by one that prints its argv, so nothing is run (a substitution that
    escaped its quotes would run, and its output break the argv)."""
    shadow = b'command_not_found_handle() { printf "%s\\0" "$@"; }; rm() { printf "%s\\0" rm "$@"; }\n'
    done = subprocess.run([BASH, b"-c", shadow + command + b"\n"], cwd=cwd, capture_output=True, timeout=30,
                          env={"PATH": "/nonexistent", "HOME": cwd})
    assert done.returncode == 0 and not done.stderr, (command, done.stderr)
    return done.stdout.split(b"\0")[:-1]
