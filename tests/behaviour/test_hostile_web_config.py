"""A hostile --web.config.file, or hostile files it names, at start and swapped in while
serving (issue 42's attacks): FIFOs, /dev/zero, 50 MB, nested YAML aliases, a list where a
string belongs, a bcrypt cost of 31. At start: one line naming the flag, exit 2, within 2 s
and 100 MiB. While serving: every request answered with the last good config, the reload
metric 0, no CPU burned; then the good file back, and SIGTERM ends the process within 2 s."""

import os
import re
import shutil
import signal
import ssl
import subprocess
import sys
import tempfile
import time

import bcrypt
import pytest

from tests.conftest import REPO, Exporter, value
from tests.system.test_check import MEASURE, peak_rss
from tests.system.test_security import make_cert, write_pem
from tests.system.test_webconfig import basic, served_serial, status

RELOADED = "shmwatch_web_config_last_reload_successful"
ALICE = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4)).decode()
COST_31 = "$2b$31$" + ALICE[7:]  # well formed: bcrypt would take days on it
HEADER = "http_server_config:\n  headers:\n    X-Frame-Options: deny\n    Content-Security-Policy: {}\n"


def alias_bomb(depth):
    """10 scalars, then each level 10 aliases of the one before, inside cert_file (where the
    old reader made it a string): 10^(depth+1) once expanded, from 500 bytes."""
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, depth + 1)]
    return f"tls_server_config:\n  key_file: k\n  cert_file: [{', '.join(levels)}]\n"


def write(text):
    def make(path):
        with open(path, "w") as f:
            f.write(text)

    return make


def fifty_megabytes(path):
    with open(path, "wb") as f:  # YAML comments: the old reader scanned them for 31 s
        for _ in range(50):
            f.write(b"# padding\n" * 100_000)


def replace(path, make):
    """`make(tmp)` builds the new file beside `path`; then it takes `path`'s place at once."""
    tmp = f"{path}.new"
    make(tmp)
    os.replace(tmp, path)


def run_measured(*args, timeout=10.0):
    """shmwatch run to its end: (exit code, stderr, seconds, peak RSS in MiB); killed, and
    the test failed, if it is still running after `timeout` s. The peak is measured by a
    small parent (MEASURE): a child forked from pytest itself inherits pytest's own peak in
    its ru_maxrss, which after the hostile-client tests is over a gigabyte."""
    argv = [
        sys.executable,
        "-c",
        MEASURE,
        sys.executable,
        "-m",
        "exporter",
        "--web.listen-address=127.0.0.1:0",
        *args,
    ]
    with tempfile.TemporaryFile() as err:
        started = time.monotonic()
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            pytest.fail(f"still running after {timeout} s: {args}")
        seconds = time.monotonic() - started
        err.seek(0)
        text = err.read().decode(errors="replace")
    rss = peak_rss(text) / (1 << 20)
    text = re.sub(r"\n?peak_rss_bytes=\d+\n", "", text)
    return proc.returncode, text, seconds, rss


@pytest.fixture
def pair(tmp_path):
    return write_pem(str(tmp_path), "tls", *make_cert("127.0.0.1", san_ip="127.0.0.1"))


START = {  # name -> (how the config or a file it names is made, what the line says)
    "a FIFO as the config": ("config", os.mkfifo, "a FIFO, not a regular file"),
    "a FIFO as cert_file": (
        "cert",
        os.mkfifo,
        "tls_server_config.cert_file: cannot load",
    ),
    "a FIFO as key_file": ("key", os.mkfifo, "tls_server_config.key_file: cannot load"),
    "/dev/zero as the config": (
        "config",
        lambda p: os.symlink("/dev/zero", p),
        "a character device",
    ),
    "a 50 MB config": ("config", fifty_megabytes, "over 1 MiB"),
    "aliases nested 9 deep": (
        "config",
        write(alias_bomb(9)),
        "anchors and aliases are not accepted",
    ),
    "min_version: [TLS12]": (
        "config",
        write(
            "tls_server_config:\n  cert_file: c\n  key_file: k\n"
            "  min_version: [TLS12]\n"
        ),
        "tls_server_config.min_version: must be a string, got a list",
    ),
    "a bcrypt cost of 31": (
        "config",
        write(f"basic_auth_users:\n  alice: '{COST_31}'\n"),
        "has bcrypt cost 31, above 14",
    ),
    "a header value beyond latin-1": (
        "config",
        write(HEADER.format('"default-src \\u2014 self"')),
        "Content-Security-Policy: '\\u2014' at character 13 is not allowed in a header value",
    ),
    "a header value with CR LF": (
        "config",
        write(HEADER.format('"a\\r\\nSet-Cookie: pwn=1"')),
        "Content-Security-Policy: '\\r' at character 2 is not allowed in a header value",
    ),
}


@pytest.mark.parametrize("case", list(START))
def test_a_hostile_file_at_start_is_one_line_and_exit_2(tmp_path, pair, case):
    """The old start hung on a FIFO with nothing said, read /dev/zero to MemoryError, took 58 s
    and 4 GB on the aliases, printed a TypeError traceback (exit 1) for the list."""
    target, make, said = START[case]
    config = tmp_path / "web.yml"
    config.write_text(
        f"tls_server_config:\n  cert_file: {pair[0]}\n  key_file: {pair[1]}\n"
    )
    path = {"config": str(config), "cert": pair[0], "key": pair[1]}[target]
    os.unlink(path)
    make(path)
    code, err, seconds, rss = run_measured(
        f"--web.config.file={config}", "--no-collector.gpu", f"--shm.mount={tmp_path}"
    )
    os.unlink(path)  # pytest keeps the last runs' directories: not 50 MB of them
    print(
        f"\n{case}: exit {code} in {seconds:.2f} s, peak RSS {rss:.0f} MiB: {err.strip()}"
    )
    assert (
        code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    ), err
    assert (
        err.startswith(f"shmwatch: error: argument --web.config.file: {config}: ")
        and said in err
    ), err
    assert seconds < 2 and rss < 100, (seconds, rss)


def peak_rss_mib(pid):
    with open(f"/proc/{pid}/status") as f:
        return (
            next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
        )


def cpu_seconds(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_hostile_files_swapped_in_while_serving(tmp_path, pair):
    """Each hostile file swapped in for the config, its certificate or its key: the old
    server re-read them on the connection path, and hung every request for good on a
    FIFO (SIGKILL needed), stalled 31 s on 50 MB and 10 s on 8 levels of aliases, and took
    the cost-31 hash (a core busy, other logins timed out). Now the watcher refuses each
    (metric 0), within 100 MiB, while every request is answered at once with the last good
    config."""
    cert, key = pair
    config = tmp_path / "web.yml"
    good = f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\nbasic_auth_users:\n  alice: '{ALICE}'\n"
    config.write_text(good)
    (tmp_path / "shm").mkdir()
    context = ssl.create_default_context(cafile=cert)
    hostile = {
        "a FIFO as the config": (str(config), os.mkfifo),
        "a FIFO as cert_file": (cert, os.mkfifo),
        "a FIFO as key_file": (key, os.mkfifo),
        "/dev/zero as the config": (str(config), lambda p: os.symlink("/dev/zero", p)),
        "a 50 MB config": (str(config), fifty_megabytes),
        "aliases nested 8 deep": (str(config), write(alias_bomb(8))),
        "a bcrypt cost of 31": (str(config), write(good + f"  mallory: '{COST_31}'\n")),
    }
    healthy = "https://127.0.0.1:{}/-/healthy"
    with Exporter(
        f"--shm.mount={tmp_path / 'shm'}",
        "--no-collector.gpu",
        f"--web.config.file={config}",
        scheme="https",
        context=context,
        headers=basic("alice", "wonderland"),
    ) as exporter:
        serial, slowest = served_serial(exporter.port, context), 0.0

        def answered(reload_ok):
            nonlocal slowest
            started = time.monotonic()
            assert status(healthy.format(exporter.port), context=context)[0] == 200
            ok = value(exporter.scrape(), RELOADED) == reload_ok
            slowest = max(slowest, time.monotonic() - started)
            return ok

        for what, (path, make) in hostile.items():
            saved = tmp_path / "saved"
            shutil.copy(path, saved)
            replace(path, make)
            deadline = time.monotonic() + 10
            while not answered(0):
                assert time.monotonic() < deadline, (
                    f"{what}: not refused in 10 s: {exporter.log()[-1500:]}"
                )
                time.sleep(0.05)
            assert status(exporter.url, context=context)[0] == 401, (
                what
            )  # basic auth still on
            assert served_serial(exporter.port, context) == serial, what
            if "bcrypt" in what:  # the old code hashed at cost 31 at once, and for days
                cpu = cpu_seconds(exporter.proc.pid)
                time.sleep(1)
                assert cpu_seconds(exporter.proc.pid) - cpu < 0.5, (
                    "CPU burned with no client"
                )
            replace(path, lambda tmp: shutil.copy(saved, tmp))
            deadline = time.monotonic() + 10
            while not answered(1):
                assert time.monotonic() < deadline, (
                    f"{what}: the good file back not taken"
                )
                time.sleep(0.05)
        rss = peak_rss_mib(exporter.proc.pid)
        print(
            f"\nhostile files swapped in: slowest request {slowest * 1000:.0f} ms, peak RSS {rss:.0f} MiB"
        )
        assert (
            slowest < 2 and rss < 100
        )  # the old reader held 3 GB of /dev/zero, 821 MB of aliases
        started = time.monotonic()
        exporter.proc.send_signal(signal.SIGTERM)
        exporter.proc.wait(5)
        assert exporter.proc.returncode == 0 and time.monotonic() - started < 2, (
            exporter.log()[-1500:]
        )


def test_a_header_value_that_breaks_answers_is_refused_at_reload(tmp_path):
    """Swapped in, a value beyond latin-1 was taken and every answer (/-/healthy too) raised
    UnicodeEncodeError, the connection dropped, a liveness probe restarting the pod; CR LF
    was taken and wrote a Set-Cookie of the file's choosing into every answer. Now each is
    refused (metric 0) and answers keep the last good config's headers."""
    config, good = tmp_path / "web.yml", HEADER.format("\"default-src 'self'\"")
    config.write_text(good)
    (tmp_path / "shm").mkdir()
    healthy = "http://127.0.0.1:{}/-/healthy"

    def reloaded(exporter, ok, what):
        deadline = time.monotonic() + 10
        while value(exporter.scrape(), RELOADED) != ok:
            assert time.monotonic() < deadline, f"{what}: metric not {ok} in 10 s: {exporter.log()[-1500:]}"
            time.sleep(0.05)

    with Exporter(f"--shm.mount={tmp_path / 'shm'}", "--no-collector.gpu", f"--web.config.file={config}") as exporter:
        for hostile in ('"default-src \\u2014 self"', '"a\\r\\nSet-Cookie: pwn=1"'):
            replace(str(config), write(HEADER.format(hostile)))
            reloaded(exporter, 0, hostile)
            code, headers = status(healthy.format(exporter.port))
            assert code == 200, hostile
            assert headers.get("Content-Security-Policy") == "default-src 'self'", headers
            assert "Set-Cookie" not in headers and "pwn" not in str(headers), headers
            replace(str(config), write(good))
            reloaded(exporter, 1, "the good file back")
        assert "Traceback" not in exporter.log() and "is not allowed in a header value" in exporter.log()
