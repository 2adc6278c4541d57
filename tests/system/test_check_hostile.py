"""`shmwatch check` on a bad day: logs that are not files or have no end, servers that trickle
or answer garbage, absurd sizes. Each case runs the real command against real FIFOs, real files
and real HTTP servers on threads, and bounds its time, memory and exit code."""
import contextlib
import http.server
import json
import os
import re
import resource
import socket
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from tests.conftest import REPO, mounted_tmpfs, needs_root
from tests.system.test_check import MEASURE, PASTED, peak_rss
from tests.system.test_gpu import TWO_GPUS, config, gpu_env, stub_dir  # noqa: F401 - stub_dir: a fixture
from tests.system.test_hung_fs import HungFuse

MiB = 1 << 20
TIMEOUT = 3  # check's --timeout in these tests
MARGIN = 12  # start-up and printing, on a loaded 2-core machine
PEAK = re.compile(r"\d{16,}")  # no size check prints has 16 digits (1 PiB is 16 digits)


def run(*args, limit_as=None, timeout=TIMEOUT + 60, env=None, mount="/dev/shm"):
    """`shmwatch check --no-collector.gpu --shm.mount=/dev/shm ARGS`: (result, seconds); with
    `env`, the GPU collector runs (with that environment)."""
    gpu = () if env else ("--no-collector.gpu",)
    argv = [sys.executable, "-m", "exporter", "check", *gpu, f"--shm.mount={mount}", *args]

    def limit():
        if limit_as:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    start = time.monotonic()
    with open(os.devnull, "rb") as devnull:
        proc = subprocess.Popen(argv, cwd=REPO, stdin=devnull, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                preexec_fn=limit, env=dict(os.environ, **(env or {})))
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            pytest.fail(f"check still running after {timeout} s: {argv}")
    elapsed = time.monotonic() - start
    result = subprocess.CompletedProcess(argv, proc.returncode, out.decode(errors="replace"),
                                         err.decode(errors="replace"))
    return result, elapsed


def run_measured(*args):
    """As `run`: (exit code, stderr, seconds, check's own peak RSS in bytes: MEASURE)."""
    argv = [sys.executable, "-c", MEASURE, sys.executable, "-m", "exporter", "check", "--no-collector.gpu",
            "--shm.mount=/dev/shm", *args]
    start = time.monotonic()
    with open(os.devnull, "wb") as sink, tempfile.TemporaryFile() as errors:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=sink, stderr=errors)
        try:
            proc.wait(TIMEOUT + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        errors.seek(0)
        err = errors.read().decode(errors="replace")
    return proc.returncode, err, time.monotonic() - start, peak_rss(err)


def quick(result, elapsed):
    assert elapsed < TIMEOUT + MARGIN, f"took {elapsed:.1f} s with --timeout {TIMEOUT}"
    assert "Traceback" not in result.stderr, result.stderr


# --- logs --------------------------------------------------------------------------------------
def test_a_fifo_with_no_writer_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "server.log"
    os.mkfifo(fifo)
    result, elapsed = run(f"--log={fifo}", f"--timeout={TIMEOUT}")
    quick(result, elapsed)
    assert result.returncode == 64 and "not a regular file" in result.stderr, result


def test_dev_zero_is_refused_without_growing():
    # Under a 2 GiB address-space limit the old reader died of MemoryError (exit 1) in seconds.
    result, elapsed = run("--log=/dev/zero", f"--timeout={TIMEOUT}", limit_as=2 << 30)
    quick(result, elapsed)
    assert result.returncode == 64 and "not a regular file" in result.stderr, result


def test_a_300mb_log_without_a_newline_is_read_from_its_tail_in_bounded_memory(tmp_path):
    log = tmp_path / "server.log"
    signature = b"\nNCCL WARN Error while creating shared memory segment /dev/shm/nccl-x (size 9)\n"
    with open(log, "wb") as f:
        f.truncate(300 * MiB)  # 300 MB of NUL bytes, no newline (sparse: no disk used)
        f.seek(0, os.SEEK_END)
        f.write(signature)
    code, err, elapsed, peak = run_measured(f"--log={log}", "--timeout=30", "--output=json")
    print(f"\n300 MiB log without a newline: check's peak RSS {peak / MiB:.0f} MiB, {elapsed:.1f} s")
    assert "Traceback" not in err, err
    assert code == 1, err
    assert peak < 120 * MiB, f"peak RSS {peak / MiB:.0f} MiB for a 300 MiB line"  # the old reader: ~620


def test_tail_hits_are_found_and_say_where(tmp_path):
    log = tmp_path / "server.log"
    with open(log, "wb") as f:
        f.truncate(100 * MiB)
        f.seek(0, os.SEEK_END)
        f.write(b"\nINFO fine\n" + b"x" * (3 * MiB) + b" Bus error (core dumped)\nINFO after\n")
    result, elapsed = run(f"--log={log}", "--timeout=30", "--output=json")
    assert "Traceback" not in result.stderr, result.stderr
    findings = json.loads(result.stdout)["findings"]
    hit = next(f for f in findings if f["area"] == "log" and "SIGBUS" in f["message"])
    assert "Bus error" in hit["message"] and len(hit["message"]) < 600, hit
    assert re.search(r"server\.log at byte \d+", hit["subject"]), hit  # no line number: not read from the start
    tail = next(f for f in findings if f["area"] == "log" and "last" in f["message"])
    assert tail["severity"] == "info", tail


def test_a_log_read_past_the_deadline_is_cut_short_with_a_warning(tmp_path):
    log = tmp_path / "server.log"
    # every line holds a word the scan looks for, so each is matched: far slower than 1 s
    with open(log, "wb") as f:
        f.write(b"Bus error in worker 7, out of memory, failed to extend nothing\n" * 900_000)
    result, elapsed = run(f"--log={log}", f"--timeout={TIMEOUT}")
    quick(result, elapsed)
    assert "not read to its end within --timeout" in result.stdout, result.stdout
    assert result.returncode == 1


def test_lines_of_a_signature_s_prefix_repeated_do_not_outlast_the_timeout(tmp_path):
    # A line of 1 MiB, dense with needles, repeating half of each signature's line: a regex
    # such as `size .*exceeds` backtracks over the rest of the line at each repetition (a
    # single such line took minutes, holding the GIL, so the deadline was never looked at).
    log = tmp_path / "prompts.log"
    with open(log, "wb") as f:
        for line in PASTED:
            piece = f"Bus error {line[: len(line) // 2]} "
            f.write(((piece * (MiB // len(piece) + 1))[:MiB] + "\n").encode())
    result, elapsed = run(f"--log={log}", f"--timeout={TIMEOUT}", timeout=TIMEOUT + MARGIN + 10)
    quick(result, elapsed)
    assert "SIGBUS" in result.stdout, result.stdout


# --- HTTP: servers that trickle -----------------------------------------------------------------
@contextlib.contextmanager
def trickling_server(head=b""):
    """Answers every connection with `head`, then one byte a second, for ever."""
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn):
        with conn:
            try:
                conn.recv(65536)
                conn.sendall(head)
                while not stop.wait(1):
                    conn.sendall(b"X")
            except OSError:
                pass

    def accept():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        listener.close()


@pytest.mark.parametrize("head", [b"", b"HTTP/1.0 200 OK\r\nContent-Length: 1000000\r\n\r\n"],
                         ids=["in-the-headers", "in-the-body"])
@pytest.mark.parametrize("flag", ["--prometheus.url", "--exporter.url"])
def test_a_server_trickling_a_byte_a_second_does_not_outlast_the_timeout(flag, head):
    with trickling_server(head) as url:
        result, elapsed = run("--recommend", f"{flag}={url}", f"--timeout={TIMEOUT}", "--output=json")
    quick(result, elapsed)
    assert result.returncode in (0, 1), result
    doc = json.loads(result.stdout)
    assert doc["recommendations"][0]["source"] == "current"
    notes = " ".join(doc["recommendation_notes"])
    assert "not used" in notes and "within --timeout" in notes, notes


def test_a_trickling_prometheus_does_not_starve_the_exporter():
    """Both are asked at once: the exporter's answer is used while Prometheus still trickles."""
    body = {"ok": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} 41943040\n'}
    with trickling_server() as slow, answering_server(body) as url:
        result, elapsed = run("--recommend", f"--prometheus.url={slow}", f"--exporter.url={url}/ok",
                              f"--timeout={TIMEOUT}", "--output=json")
    quick(result, elapsed)
    doc = json.loads(result.stdout)
    rec = doc["recommendations"][0]
    assert rec["source"] == "exporter" and rec["observed_peak_bytes"] >= 41943040, rec
    assert any(n.startswith("Prometheus not used") for n in doc["recommendation_notes"]), doc


# --- HTTP: answers that are not what they should be --------------------------------------------
def vector(*values):
    return json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"mount": "/dev/shm"}, "value": [1.0, v]} for v in values]}})


PROMETHEUS_ANSWERS = {
    "list": "[1,2,3]",
    "no-data": '{"status":"success"}',
    "abc": vector("abc"),
    "nan": vector("NaN"),
    "inf": vector("+Inf"),
    "negative": vector("-5"),
    "huge": vector("1e308"),
    "number-not-string": json.dumps({"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {}, "value": [1.0, None]}]}}),
    "result-not-a-list": json.dumps({"status": "success", "data": {"resultType": "vector", "result": "x"}}),
    "matrix": json.dumps({"status": "success", "data": {"resultType": "matrix", "result": []}}),
    "deep": "[" * 200_000 + "]" * 200_000,
    "not-json": "<html>proxy error</html>",
    "error-with-escapes": json.dumps({"status": "error", "error": "\x1b[2J" + "x" * 100_000}),
    "too-large": '{"status":"success","pad":"' + "x" * (8 * MiB) + '"}',
    "invalid-utf8": b'{"status":"\xff\xfe"}',
}
EXPORTER_BODIES = {
    "nan": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} NaN\n',
    "inf": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} +Inf\n',
    "huge": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} 1e308\n',
    "negative": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} -1\n',
    "garbage": 'shmwatch_mount_max_used_bytes{mount="/dev/shm" 12\n{{{\n',
    "binary": b"\x00\xff" * 1000,
}


@contextlib.contextmanager
def answering_server(bodies):
    """GET /<case>/... answers bodies[case] with 200."""
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = bodies[self.path.split("/")[1].split("?")[0]]
            body = body.encode() if isinstance(body, str) else body
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(OSError):  # check stops reading a body that is too long
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def recommend_from(flag, url):
    result, elapsed = run("--recommend", f"{flag}={url}", f"--timeout={TIMEOUT}", "--output=json")
    quick(result, elapsed)
    assert result.returncode in (0, 1), result
    doc = json.loads(result.stdout)
    advice = json.dumps([doc["recommendations"], doc["recommendation_notes"]])
    assert not PEAK.search(advice), advice  # (the facts hold the kernel's shmmax: 2^64 - 16 MiB - 1)
    rec = doc["recommendations"][0]
    assert rec["source"] == "current", rec  # the fallback
    assert rec["recommended_size_bytes"] <= 1 << 50
    return doc


@pytest.mark.parametrize("case", sorted(PROMETHEUS_ANSWERS))
def test_a_broken_prometheus_answer_is_a_note_and_a_fallback(case):
    with answering_server(PROMETHEUS_ANSWERS) as url:
        doc = recommend_from("--prometheus.url", f"{url}/{case}")
    notes = doc["recommendation_notes"]
    assert any(n.startswith("Prometheus not used") for n in notes), notes
    assert all(len(n) < 400 and "\x1b" not in n for n in notes), notes


@pytest.mark.parametrize("case", sorted(EXPORTER_BODIES))
def test_a_broken_exporter_answer_is_a_note_and_a_fallback(case):
    with answering_server(EXPORTER_BODIES) as url:
        doc = recommend_from("--exporter.url", f"{url}/{case}/metrics")
    assert any(n.startswith("exporter not used") for n in doc["recommendation_notes"]), doc


def test_a_huge_peak_is_refused_and_the_exporter_answers_instead():
    bodies = {"huge": vector("1e308"), "ok": 'shmwatch_mount_max_used_bytes{mount="/dev/shm"} 41943040\n'}
    with answering_server(bodies) as url:
        result, elapsed = run("--recommend", f"--prometheus.url={url}/huge", f"--exporter.url={url}/ok",
                                 f"--timeout={TIMEOUT}")
    quick(result, elapsed)
    assert not PEAK.search(result.stdout), result.stdout
    assert "not a plausible size" in result.stdout and "high-water mark" in result.stdout, result.stdout


# --- flags, requirements and exit codes --------------------------------------------------------
def test_recommend_is_never_below_require_shm():
    result, _ = run("--recommend", "--require-shm=16G", "--output=json")
    rec = json.loads(result.stdout)["recommendations"][0]
    assert rec["recommended_size_bytes"] >= 16_000_000_000, rec
    assert rec["settings"]["docker_run"] == "docker run --shm-size=15g", rec  # 15 GiB holds 16 G
    assert any("--require-shm" in n for n in rec["notes"]), rec


@pytest.mark.parametrize("args", [["--timeout=nan"], ["--timeout=-1"], ["--timeout=inf"],
                                  ["--require-shm=99999999999999999999Ei"],
                                  ["--recommend", "--prometheus.url=file:///dev/zero"],
                                  ["--recommend", "--exporter.url=localhost:9841"]])
def test_absurd_flag_values_are_usage_errors(args):
    result, _ = run(*args)
    assert result.returncode == 64, result
    assert "Traceback" not in result.stderr and len(result.stdout) == 0, result


def test_an_internal_error_exits_70_not_1(capsys):
    from exporter.check.report import EXIT_SOFTWARE, main

    def broken(cfg, timeout):
        raise RuntimeError("a bug")

    assert EXIT_SOFTWARE == 70
    assert main(["--no-collector.gpu", "--shm.mount=/dev/shm"], broken) == 70
    assert "internal error" in capsys.readouterr().err


@needs_root
def test_a_log_on_a_hung_filesystem_does_not_outlast_the_timeout(tmp_path):
    """The log is on a FUSE filesystem whose server has stopped: stat() and read() of it never
    return. check reports it unread and exits on time."""
    with HungFuse(tmp_path, tmp_path / "logs") as fuse:
        fuse.stop()
        result, elapsed = run(f"--log={fuse.mnt / 'weights.bin'}", f"--timeout={TIMEOUT}")
    quick(result, elapsed)
    assert "not read within --timeout" in result.stdout and result.returncode == 1, result


@needs_root
def test_a_process_whose_maps_do_not_answer_does_not_outlast_the_timeout(tmp_path):
    """A /proc whose one extra process has maps that block on open (a FIFO, as a D-state
    process's maps block on its mmap lock): the NCCL look at every process's maps (made when
    the mount holds no nccl-* file) is left behind at the deadline and said to be unchecked."""
    proc = tmp_path / "proc"
    proc.mkdir()
    for name in os.listdir("/proc"):
        os.symlink(f"/proc/{name}", proc / name)
    (proc / "4194304").mkdir()  # above any pid_max: never a real process
    os.mkfifo(proc / "4194304" / "maps")
    with mounted_tmpfs() as mount:
        result, elapsed = run(f"--path.procfs={proc}", f"--timeout={TIMEOUT}", timeout=TIMEOUT + MARGIN + 10,
                              mount=mount)
    quick(result, elapsed)
    assert "maps not read within --timeout" in result.stdout, result.stdout


def test_a_gpu_fallen_off_the_bus_does_not_outlast_the_timeout(request, tmp_path):
    """NVML blocks, and so does nvmlShutdown until the blocked call returns (a driver lock):
    check leaves the GPU's run behind at its deadline instead of shutting NVML down under it."""
    hang = tmp_path / "hang"
    hang.touch()
    conf = config(tmp_path, TWO_GPUS + f"hang_file={hang}\nhang_holds_shutdown=1\n")
    try:
        result, elapsed = run(f"--timeout={TIMEOUT}", env=gpu_env(request.getfixturevalue("stub_dir"), conf))
    finally:
        hang.unlink()
    quick(result, elapsed)
    assert "GPU memory not checked: no answer within --timeout" in result.stdout, result.stdout
