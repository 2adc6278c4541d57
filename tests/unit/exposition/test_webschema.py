"""exporter/exposition/webschema.py: the web config and the files it names read as untrusted
input. Only a regular file of at most 1 MiB is read; YAML anchors, aliases, repeated keys and
more nodes or levels than a web config holds are refused before they cost anything; every
field of exporter-toolkit's schema has its type checked, in one line that names it."""
import os
import socket
import threading
import time
import tracemalloc

import pytest

from exporter.exposition import webschema
from exporter.exposition.webschema import WebConfigError, parse, read_file

HASH = "$2b$10$" + "a" * 53  # well formed: parse() never runs bcrypt


def refused(call, *args):
    """The message of the WebConfigError call(*args) raises, from a thread given 2 s: a read
    that blocks (a FIFO opened without O_NONBLOCK) fails the test instead of hanging it."""
    outcome = []

    def run():
        try:
            call(*args)
            outcome.append("accepted")
        except WebConfigError as err:
            outcome.append(str(err))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(2)
    assert outcome, f"{call.__name__}{args} still running after 2 s"
    assert outcome[0] != "accepted", f"{call.__name__}{args} was accepted"
    assert "\n" not in outcome[0], outcome[0]
    return outcome[0]


def test_only_a_regular_file_is_opened_or_read(tmp_path):
    """A FIFO with no writer blocked open() for good; /dev/zero was read until MemoryError."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "socket"))
        kinds = {str(fifo): "a FIFO", "/dev/zero": "a character device", str(tmp_path): "a directory",
                 str(tmp_path / "socket"): "a socket"}
        for path, kind in kinds.items():
            assert refused(read_file, path) == f"{kind}, not a regular file"
    assert refused(read_file, str(tmp_path / "missing")) == "No such file or directory"
    os.symlink("/dev/zero", tmp_path / "link")  # followed (Kubernetes' secrets are links), then refused
    assert refused(read_file, str(tmp_path / "link")) == "a character device, not a regular file"


def test_a_file_over_1_mib_is_refused_unread(tmp_path):
    """1 MiB is read; a byte more is refused, and a 50 MB file is refused without being read
    (its size is seen first): little memory, no time."""
    path = tmp_path / "web.yml"
    path.write_bytes(b"#" * webschema.MAX_FILE_BYTES)
    assert len(read_file(str(path))) == webschema.MAX_FILE_BYTES
    with open(path, "ab") as f:
        f.write(b"#")
    assert refused(read_file, str(path)) == "over 1 MiB"
    os.truncate(path, 50_000_000)
    tracemalloc.start()
    try:
        assert refused(read_file, str(path)) == "over 1 MiB"
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak} bytes held to refuse a 50 MB file"


def alias_bomb(depth):
    """10 scalars, then each level 10 aliases of the one before, inside cert_file (where the
    old reader made it a string): 10^(depth+1) once expanded, from 500 bytes."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, depth + 1)]
    return f"tls_server_config:\n  key_file: k\n  cert_file: [{', '.join(levels)}]\n"


@pytest.mark.parametrize("depth", [8, 9])
def test_yaml_aliases_are_refused_before_they_expand(depth):
    """The old reader took 58 s and 4 GB on 9 levels, then MemoryError."""
    tracemalloc.start()
    started = time.monotonic()
    try:
        message = refused(parse, alias_bomb(depth))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    print(f"\n{depth} levels of aliases: refused in {time.monotonic() - started:.3f} s, peak {peak >> 10} KiB")
    assert message == "line 3: YAML anchors and aliases are not accepted"
    assert peak < 1 << 20
    assert "anchors and aliases" in refused(parse, "basic_auth_users:\n  alice: &h x\n")


def test_more_yaml_than_a_web_config_holds_is_refused_early():
    """1 MiB of flow list takes pure-Python YAML 13 s; nesting 2,000 deep hit the
    interpreter's recursion limit (a traceback). Refused at the first node past the caps."""
    too_many = "x: [" + "0, " * 300_000 + "]\n"
    too_deep = "x: " + "[" * 2000 + "]" * 2000 + "\n"
    for text in (too_many, too_deep):
        started = time.monotonic()
        assert "more YAML than a web config holds" in refused(parse, text)
        assert time.monotonic() - started < 1.5
    nested = "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
    assert parse(nested).headers == (("X-Frame-Options", "deny"),)


TYPES = [
    ("tls_server_config:\n  min_version: [TLS12]\n", "tls_server_config.min_version: must be a string, got a list"),
    ("tls_server_config:\n  cert_file: {a: b}\n", "tls_server_config.cert_file: must be a string, got a mapping"),
    ("tls_server_config:\n  client_auth_type: 1\n",
     "tls_server_config.client_auth_type: must be a string, got a number"),
    ("tls_server_config:\n  key_file: true\n", "tls_server_config.key_file: must be a string, got a boolean"),
    ("tls_server_config:\n  client_ca_file: 2024-01-01\n",
     "tls_server_config.client_ca_file: must be a string, got a date"),
    ("tls_server_config:\n  max_version: 1.3\n", "tls_server_config.max_version: must be a string, got a number"),
    ("tls_server_config:\n  cipher_suites: TLS_AES_128_GCM_SHA256\n",
     "tls_server_config.cipher_suites: must be a list, got a string"),
    ("tls_server_config:\n  curve_preferences: X25519\n",
     "tls_server_config.curve_preferences: must be a list, got a string"),
    ("tls_server_config:\n  prefer_server_cipher_suites: 'yes'\n",
     "tls_server_config.prefer_server_cipher_suites: must be true or false, got a string"),
    ("tls_server_config: [cert_file]\n", "tls_server_config: must be a mapping, got a list"),
    ("http_server_config:\n  http2: 'true'\n", "http_server_config.http2: must be true or false, got a string"),
    ("http_server_config:\n  headers: [X-Frame-Options]\n",
     "http_server_config.headers: must be a mapping, got a list"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: [deny]\n",
     "http_server_config.headers.X-Frame-Options: must be a string, got a list"),
    ("basic_auth_users: [alice]\n", "basic_auth_users: must be a mapping, got a list"),
    ("basic_auth_users:\n  alice: [x]\n", "basic_auth_users: the password of 'alice': must be a string, got a list"),
    ("basic_auth_users:\n  yes: x\n", "basic_auth_users: the user name True must be quoted"),
    ("rate_limit: 10\n", "rate_limit: must be a mapping, got a number"),
    ("- tls_server_config\n", "top level: must be a mapping, got a list"),
]


@pytest.mark.parametrize("text,message", TYPES)
def test_every_field_has_its_type_checked(text, message):
    """A list where a string belongs was a TypeError traceback (exit 1); now one line
    naming the field, whichever field."""
    assert refused(parse, text) == message


def test_a_key_given_twice_is_refused():
    """As yaml.v2's UnmarshalStrict refuses it: a second, empty basic_auth_users would
    otherwise open /metrics while the first one is what a reader of the file sees."""
    text = f"basic_auth_users:\n  alice: '{HASH}'\nbasic_auth_users:\n"
    assert refused(parse, text) == "line 3: basic_auth_users is given twice"


def test_bcrypt_costs_above_14_are_refused():
    """One user at cost 31 kept a core busy with no client at all, and every other login
    timed out: refused, with the cap named. 14 is taken, 4 too."""
    assert parse(f"basic_auth_users:\n  a: '{HASH.replace('$10$', '$14$')}'\n").users
    assert parse(f"basic_auth_users:\n  a: '{HASH.replace('$10$', '$04$')}'\n").users
    for cost in ("15", "31"):
        message = refused(parse, f"basic_auth_users:\n  a: '{HASH.replace('$10$', f'${cost}$')}'\n")
        assert message.startswith(f"basic_auth_users: the password of 'a' has bcrypt cost {cost}, above 14"), message


def test_names_from_the_file_cannot_break_the_line():
    for text in ('"evil\\nfield": 1\n', 'basic_auth_users:\n  "a\\x1b[2J": x\n',
                 'http_server_config:\n  headers:\n    "X\\rY": z\n'):
        message = refused(parse, text)
        assert message.isprintable(), message


def test_a_header_given_as_a_number_is_its_text():
    """`X-XSS-Protection: 0` is a number to YAML and a string to Go's yaml.v2."""
    text = "http_server_config:\n  headers:\n    X-XSS-Protection: 0\n"
    assert parse(text).headers == (("X-XSS-Protection", "0"),)


FIELD_VALUES = [  # the value as YAML writes it, what the line says
    ('"default-src \\u2014 self"', "'\\u2014' at character 13"),  # not latin-1: every answer raised
    ('"a\\r\\nSet-Cookie: pwn=1"', "'\\r' at character 2"),  # a header of the file's choosing
    ('"a\\nb"', "'\\n' at character 2"),
    ('"a\\x01b"', "'\\x01' at character 2"),
    ('"a\\x7fb"', "'\\x7f' at character 2"),
    ('"caf\\xe9"', "'\\xe9' at character 4"),  # obs-text: Go keeps it, nothing needs it
    ('" self"', "' ' at character 1"),
    ('"self\\t"', "'\\t' at character 5"),
]


@pytest.mark.parametrize("value,said", FIELD_VALUES, ids=[v for v, _ in FIELD_VALUES])
def test_a_header_value_that_is_no_rfc_9110_field_value_is_refused(value, said):
    """Values were written as given: U+2014 made every answer (/-/healthy too) raise
    UnicodeEncodeError, and CR LF wrote a header of the file's choosing."""
    text = f"http_server_config:\n  headers:\n    Content-Security-Policy: {value}\n"
    message = refused(parse, text)
    assert message.startswith(f"http_server_config.headers.Content-Security-Policy: {said} is not allowed"), message
    assert message.isprintable(), message


def test_header_values_of_visible_ascii_with_spaces_and_tabs_between_are_taken():
    text = ("http_server_config:\n  headers:\n    Content-Security-Policy: \"default-src 'self';\\tframe-ancestors"
            "  'none'\"\n    Strict-Transport-Security: max-age=31536000; includeSubDomains\n")
    assert parse(text).headers == (("Content-Security-Policy", "default-src 'self';\tframe-ancestors  'none'"),
                                   ("Strict-Transport-Security", "max-age=31536000; includeSubDomains"))
