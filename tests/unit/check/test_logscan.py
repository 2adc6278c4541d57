"""logscan.py: `check --log` on real files: each signature's first hit by line and byte,
how many lines matched, the tail of a log over the bound, a deadline, what is not a regular
file, and the findings it makes."""

import math
import os
import threading
import time

import pytest

from exporter.check import logscan
from exporter.check.findings import Bounded, Report
from exporter.check.logscan import log_findings, refusal, scan_log

NCCL = ("host:1:2 [0] NCCL INFO misc/shmutils.cc:87 NCCL WARN Error while creating shared memory segment "
        "/dev/shm/nccl-AbCdEf (size 9637888), error: No space left on device (28)")
UCX = ("[1700000000.1] [host:1:0] sys.c:1 UCX ERROR shmget(size=4263936 flags=0x7b0) for mm_recv_desc "
       "failed: No space left on device, please check shared memory limits by 'ipcs -l'")


def write_log(tmp_path, lines, name="server.log"):
    path = tmp_path / name
    path.write_bytes(b"".join((line.encode() if isinstance(line, str) else line) + b"\n" for line in lines))
    return str(path)


def test_the_first_hit_of_each_signature_with_its_line_and_offset(tmp_path):
    lines = ["starting", "loading weights", NCCL, "retrying", UCX, NCCL.replace("AbCdEf", "second")]
    path = write_log(tmp_path, lines)
    scan = scan_log(path)
    assert set(scan.hits) == {"nccl_shm_create", "ucx_shmget"}
    nccl = scan.hits["nccl_shm_create"]
    assert (nccl.file, nccl.line, nccl.offset) == (path, 3, len("starting\nloading weights\n"))
    assert "nccl-AbCdEf" in nccl.text and nccl.text.endswith("[2 matching line(s)]")  # the first, and a count
    ucx = scan.hits["ucx_shmget"]
    assert ucx.line == 5 and "[" not in ucx.text.split("ipcs")[-1]  # one line: no count
    assert (scan.size, scan.start, scan.end) == (os.path.getsize(path), 0, os.path.getsize(path))


def test_a_log_without_a_signature_has_no_hits_however_near_a_needle(tmp_path):
    # the needle alone, without what the regex asks for, is no hit
    path = write_log(tmp_path, ["NCCL WARN Error while doing something else", "shmget(size=abc) for x failed"])
    assert scan_log(path).hits == {}


def test_a_hit_quotes_bytes_that_are_not_utf8_escaped(tmp_path):
    path = write_log(tmp_path, [NCCL.encode().replace(b"AbCdEf", b"Ab\xffEf")])
    hit = scan_log(path).hits["nccl_shm_create"]
    assert "\\xff" in hit.text and "\udcff" not in hit.text


def test_only_the_tail_of_a_long_log_is_read_from_a_whole_line(tmp_path, monkeypatch):
    monkeypatch.setattr(logscan, "MAX_LOG_BYTES", 4096)
    monkeypatch.setattr(logscan, "CHUNK", 1024)
    early = NCCL.replace("AbCdEf", "early")
    filler = [f"line {i:04d} " + "." * 60 for i in range(100)]
    path = write_log(tmp_path, [early] + filler + [UCX] + filler[:5])
    size = os.path.getsize(path)
    scan = scan_log(path)
    assert (scan.size, scan.start, scan.end) == (size, size - 4096, size)
    assert set(scan.hits) == {"ucx_shmget"}  # the NCCL line is before the tail
    hit = scan.hits["ucx_shmget"]
    assert hit.line is None  # lines are not counted from the middle of a log
    with open(path, "rb") as f:
        assert f.read()[hit.offset:].startswith(b"[1700000000.1]")  # the byte its line starts at


def test_a_line_the_tail_begins_inside_is_left_out(tmp_path, monkeypatch):
    """Its end could still match (the tail cut its timestamp off), but a line not read whole
    is not judged."""
    filler = ["z" * 40] * 3
    path = write_log(tmp_path, filler + [UCX] + filler)
    size, ucx_at = os.path.getsize(path), 3 * 41
    monkeypatch.setattr(logscan, "MAX_LOG_BYTES", size - (ucx_at + 5))
    scan = scan_log(path)
    assert scan.start == ucx_at + 5 and scan.hits == {}


def test_a_hit_across_chunks_of_whole_lines_is_found_once(tmp_path, monkeypatch):
    monkeypatch.setattr(logscan, "CHUNK", 256)
    filler = ["x" * 100] * 7
    path = write_log(tmp_path, filler + [UCX] + filler + [UCX])
    hit = scan_log(path).hits["ucx_shmget"]
    assert hit.line == 8 and hit.offset == 7 * 101 and hit.text.endswith("[2 matching line(s)]")


def test_a_deadline_already_past_reads_nothing_and_says_where_it_stopped(tmp_path):
    path = write_log(tmp_path, [NCCL])
    scan = scan_log(path, deadline=time.monotonic() - 1)
    assert (scan.hits, scan.start, scan.end) == ({}, 0, 0) and scan.size == os.path.getsize(path)
    report = Report()
    log_findings(report, [(path, Bounded(lambda: scan))], math.inf)
    [finding] = report.findings
    assert (finding.severity, finding.subject) == ("warn", "server.log")
    assert finding.message == f"not read to its end within --timeout: 0 B of {scan.size} B read"


def test_a_fifo_is_refused_at_once_not_waited_on(tmp_path):
    fifo = str(tmp_path / "pipe")
    os.mkfifo(fifo)
    done = []
    reader = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, scan_log, fifo)), daemon=True)
    reader.start()
    reader.join(5)
    assert done and "not a regular file" in str(done[0].value)  # no writer: open(2) would block
    assert refusal(fifo) == "not a regular file"


def test_refusal_names_why_a_log_is_not_read(tmp_path):
    assert refusal(str(tmp_path)) == "not a regular file"
    assert refusal(str(tmp_path / "missing.log")) == "cannot read it: No such file or directory"
    assert refusal(write_log(tmp_path, ["fine"])) == ""


def test_findings_name_each_signature_once_with_its_explanation_and_remedy(tmp_path):
    first = write_log(tmp_path, ["ok", NCCL], "rank0.log")
    second = write_log(tmp_path, [NCCL.replace("AbCdEf", "other"), UCX], "rank1.log")
    report = Report()
    tasks = [(p, Bounded(lambda p=p: scan_log(p))) for p in (first, second)]
    log_findings(report, tasks, time.monotonic() + 10)
    by_subject = {f.subject: f for f in report.findings}
    assert sorted(by_subject) == ["rank0.log:2", "rank1.log:2"]  # NCCL once: its first log's hit
    nccl, ucx = by_subject["rank0.log:2"], by_subject["rank1.log:2"]
    assert nccl.severity == ucx.severity == "warn" and nccl.area == "log"
    assert nccl.message.startswith(logscan.TABLE["nccl_shm_create"]["explanation"])
    assert "Seen: " in nccl.message and "nccl-AbCdEf" in nccl.message and "other" not in nccl.message
    assert nccl.remedy == logscan.TABLE["nccl_shm_create"]["remedy"]
    assert ucx.remedy == logscan.TABLE["ucx_shmget"]["remedy"]


def test_findings_say_which_logs_were_not_read_and_why(tmp_path, monkeypatch):
    monkeypatch.setattr(logscan, "MAX_LOG_BYTES", 64)
    long_log = write_log(tmp_path, ["y" * 50] * 4, "long.log")
    report = Report()
    hung = threading.Event()
    tasks = [
        (str(tmp_path / "gone.log"), Bounded(lambda: scan_log(str(tmp_path / "gone.log")))),
        (str(tmp_path / "hung.log"), Bounded(hung.wait)),
        (long_log, Bounded(lambda: scan_log(long_log))),
    ]
    log_findings(report, tasks, time.monotonic() + 0.5)
    hung.set()
    said = {(f.severity, f.subject, f.message) for f in report.findings}
    assert ("warn", "gone.log", f"not read: [Errno 2] No such file or directory: '{tmp_path}/gone.log'") in said
    assert ("warn", "hung.log", "not read within --timeout") in said
    assert ("info", "long.log", "only its last 64 B of 204 B read") in said
    assert len(said) == 3
