"""`shmwatch check` on real tmpfs mounts, its JSON shape, exit codes, and log signatures."""
import json
import os
import re
import subprocess
import sys

import jsonschema
from hypothesis import example, given, settings
from hypothesis import strategies as st

from exporter.check.recommend import memory_limit_needed, settings_for
from exporter.check.report import shm_remedy
from exporter.check.findings import at_least, at_most, quantities, round_up
from exporter.config import parse_size
from tests.conftest import REPO, Peer, mounted_tmpfs, needs_root, prerequisite_missing

# The documented, stable shape of `shmwatch check --output json` (README: "shmwatch check").
FINDING = {"type": "object", "required": ["severity", "area", "subject", "message", "remedy"],
           "additionalProperties": False,
           "properties": {"severity": {"enum": ["fail", "warn", "info", "ok"]},
                          "area": {"enum": ["gpu", "shm", "memory", "sysv", "log"]},
                          "subject": {"type": "string"}, "message": {"type": "string"},
                          "remedy": {"type": "string"}}}
SHM = {"type": "object",
       "required": ["mount", "fstype", "size_bytes", "used_bytes", "available_bytes", "effective_size_bytes"],
       "properties": {"mount": {"type": "string"}, "size_bytes": {"type": "integer"},
                      "used_bytes": {"type": "integer"}, "effective_size_bytes": {"type": "integer"},
                      "bytes_by_class": {"type": "object", "additionalProperties": {"type": "integer"}},
                      "orphans": {"type": "array", "items": {
                          "type": "object", "required": ["name", "class", "bytes", "age_seconds"]}},
                      "hidden_bytes": {"type": "integer"}, "segments": {"type": "integer"}}}
NULLABLE_INT = {"type": ["integer", "null"]}
RECOMMENDATION = {
    "type": "object",
    "required": ["mount", "observed_peak_bytes", "recommended_size_bytes", "window", "source",
                 "memory_limit_bytes_needed", "settings"],
    "properties": {"mount": {"type": "string"}, "observed_peak_bytes": {"type": "integer"},
                   "recommended_size_bytes": {"type": "integer", "minimum": 1 << 20},
                   "window": {"type": ["string", "null"]}, "source": {"enum": ["prometheus", "exporter", "current"]},
                   "current_size_bytes": {"type": "integer"}, "memory_limit_bytes": NULLABLE_INT,
                   "memory_limit_bytes_needed": NULLABLE_INT, "memory_limit_fits": {"type": ["boolean", "null"]},
                   "settings": {"type": "object", "required": ["docker_run", "compose", "kubernetes_volume",
                                                               "kubectl_patch"],
                                "additionalProperties": {"type": "string"}},
                   "notes": {"type": "array", "items": {"type": "string"}}}}
SCHEMA = {"type": "object",
          "required": ["version", "shmwatch_version", "status", "exit_code", "findings", "shm", "gpus",
                       "host_memory", "cgroup", "pod_cgroups", "sysv", "recommendations"],
          "properties": {"version": {"const": 1}, "status": {"enum": ["ok", "warn", "fail"]},
                         "exit_code": {"enum": [0, 1, 2]}, "findings": {"type": "array", "items": FINDING},
                         "shm": {"type": "array", "items": SHM}, "gpus": {"type": "array"},
                         "host_memory": {"type": ["object", "null"]}, "cgroup": {"type": ["object", "null"]},
                         "pod_cgroups": {"type": "array"},
                         "sysv": {"type": ["object", "null"]},
                         "recommendations": {"type": "array", "items": RECOMMENDATION},
                         "recommendation_notes": {"type": "array", "items": {"type": "string"}}}}


# wait4() of a child this process started reports at least this process's own peak RSS (an
# exec keeps the peak of the memory it replaces), and pytest's grows with the suite: this
# small Python runs the command as its child and writes that child's own peak to stderr.
MEASURE = """import os, sys
pid = os.fork()
if not pid:
    os.execvp(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
sys.stderr.write(f"\\npeak_rss_bytes={usage.ru_maxrss * 1024}\\n")
sys.exit(os.waitstatus_to_exitcode(status))
"""


def peak_rss(output: str) -> int:
    return int(re.search(r"peak_rss_bytes=(\d+)", output).group(1))


def check(*args):
    return subprocess.run([sys.executable, "-m", "exporter", "check", "--no-collector.gpu", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


@needs_root
def test_docker_default_is_named_and_require_fails():
    with mounted_tmpfs("64m") as shm:
        plain = check(f"--shm.mount={shm}")
        required = check(f"--shm.mount={shm}", "--require-shm", "1Gi")
        as_json = check(f"--shm.mount={shm}", "--require-shm", "1Gi", "--output", "json")
    assert plain.returncode == 1, plain.stdout + plain.stderr
    first = plain.stdout.splitlines()[3]
    assert first.startswith("WARN") and "Docker's 64 MiB default" in first
    assert "--shm-size=16g" in plain.stdout and "sizeLimit: 16Gi" in plain.stdout
    assert required.returncode == 2
    assert required.stdout.splitlines()[3].startswith("FAIL") and "1.0 GiB required" in required.stdout
    doc = json.loads(as_json.stdout)
    jsonschema.validate(doc, SCHEMA)
    assert doc["exit_code"] == as_json.returncode == 2 and doc["status"] == "fail"
    assert doc["findings"][0]["severity"] == "fail"  # worst first
    assert doc["shm"][0]["size_bytes"] == 64 << 20 and doc["shm"][0]["mount"] == shm


@needs_root
def test_require_shm_is_held_to_the_effective_size():
    """A 2 GiB tmpfs under a 512 MiB memory limit can hold 512 MiB: --require-shm=1Gi fails."""
    with mounted_tmpfs("2g") as shm:
        result = check(f"--shm.mount={shm}", "--memory.limit-bytes=512Mi", "--no-collector.cgroup",
                       "--require-shm=1Gi", "--output=json")
        enough = check(f"--shm.mount={shm}", "--memory.limit-bytes=1Gi", "--no-collector.cgroup",
                       "--require-shm=1Gi", "--output=json")
    doc = json.loads(result.stdout)
    assert result.returncode == 2, result.stdout + result.stderr
    assert doc["shm"][0]["size_bytes"] == 2 << 30 and doc["shm"][0]["effective_size_bytes"] == 512 << 20
    fail = next(f for f in doc["findings"] if f["severity"] == "fail")
    assert "can hold 512.0 MiB, below the 1.0 GiB required" in fail["message"]
    assert enough.returncode in (0, 1) and not [f for f in json.loads(enough.stdout)["findings"]
                                                if f["severity"] == "fail"], enough.stdout


@needs_root
def test_backend_vllm_warns_under_16gi():
    with mounted_tmpfs("2g") as shm:
        result = check(f"--shm.mount={shm}", "--backend", "vllm")
        trt = check(f"--shm.mount={shm}", "--backend", "trtllm", "--output", "json")
    assert result.returncode == 1, result.stdout
    assert "under the 16.0 GiB recommended for vllm" in result.stdout
    assert "Docker's" not in result.stdout
    warnings = [f for f in json.loads(trt.stdout)["findings"] if f["severity"] == "warn"]
    assert any("80.0 GiB recommended for trtllm" in f["message"] for f in warnings)


@needs_root
def test_large_enough_is_ok():
    with mounted_tmpfs("20g") as shm:
        result = check(f"--shm.mount={shm}", "--backend", "vllm", "--require-shm", "16Gi")
    assert result.returncode == 0, result.stdout
    assert "OK     shm" in result.stdout


@needs_root
def test_leaked_segments_are_named_with_their_removal():
    with mounted_tmpfs("64m") as shm:
        with Peer(shm, "leak", str(4 << 20)) as leak:
            leak.proc.wait(10)
        doc = json.loads(check(f"--shm.mount={shm}", "--output", "json").stdout)
    leaked = next(f for f in doc["findings"] if "leaked segment" in f["message"])
    path = os.path.join(shm, leak.info)
    assert path in leaked["message"] and leaked["remedy"].endswith(f"rm -- {path}")
    assert doc["shm"][0]["orphans"][0]["name"] == leak.info and doc["shm"][0]["orphans"][0]["bytes"] == 4 << 20


@needs_root
def test_node_mode_check_reports_pod_cgroups(tmp_path):
    import uuid
    uid = str(uuid.uuid4())
    v1 = "/sys/fs/cgroup/memory"
    if not os.path.exists(os.path.join(v1, "memory.usage_in_bytes")):
        prerequisite_missing("no cgroup v1 memory controller")
    cg = os.path.join(v1, "kubepods", "burstable", f"pod{uid}")
    os.makedirs(cg)
    path = str(tmp_path / "var/lib/kubelet/pods" / uid / "volumes/kubernetes.io~empty-dir/dshm")
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(64 << 20))
        with mounted_tmpfs("128m", path=path):
            result = check("--mode=node", "--output", "json")
        doc = json.loads(result.stdout)
        jsonschema.validate(doc, SCHEMA)
        # Only our pod among them (other tests on this machine may have pods of their own).
        assert [c["pod_uid"] for c in doc["pod_cgroups"] if c["pod_uid"] == uid] == [uid]
        shm = next(m for m in doc["shm"] if m["mount"] == path)
        assert shm["effective_size_bytes"] <= 64 << 20  # the pod's limit caps its emptyDir
    finally:
        for d in (cg, os.path.dirname(cg), os.path.dirname(os.path.dirname(cg))):
            try:
                os.rmdir(d)
            except OSError:
                pass


@needs_root
def test_recommend_says_when_the_memory_limit_must_grow():
    """60 MiB in use under a 64 MiB limit: 75 MiB of shm cannot fit, the limit must grow."""
    with mounted_tmpfs("256m") as shm:
        with open(os.path.join(shm, "psm_load"), "wb") as f:
            f.write(b"\1" * (60 << 20))
        result = check(f"--shm.mount={shm}", "--memory.limit-bytes=64Mi", "--recommend", "--output", "json")
        text = check(f"--shm.mount={shm}", "--memory.limit-bytes=64Mi", "--recommend")
        plain = check(f"--shm.mount={shm}", "--output", "json")
    doc = json.loads(result.stdout)
    jsonschema.validate(doc, SCHEMA)
    jsonschema.validate(json.loads(plain.stdout), SCHEMA)
    assert json.loads(plain.stdout)["recommendations"] == []  # only with --recommend
    rec = doc["recommendations"][0]
    assert rec["source"] == "current" and rec["observed_peak_bytes"] == 60 << 20
    assert rec["recommended_size_bytes"] == 75 << 20 and rec["memory_limit_fits"] is False
    assert rec["memory_limit_bytes"] == 64 << 20 and rec["memory_limit_bytes_needed"] >= 75 << 20
    need_mi = rec["memory_limit_bytes_needed"] >> 20
    assert rec["settings"]["kubernetes_memory_limit"].endswith(f"--limits=memory={need_mi}Mi")
    assert rec["settings"]["docker_run_memory"] == f"docker run --memory={need_mi}m"
    assert '"sizeLimit":"75Mi"' in rec["settings"]["kubectl_patch"]
    warning = next(f for f in doc["findings"] if "does not fit" in f["message"])
    from exporter.check.findings import at_least  # the working set is this machine's: MiB or GiB
    needed = at_least(rec["memory_limit_bytes_needed"])
    assert warning["severity"] == "warn" and f"raise the memory limit to {needed}," in warning["remedy"]
    assert result.returncode == 1
    assert "cannot hold it: raise the limit to" in text.stdout and "--shm-size=75m" in text.stdout


# Every size a piece of advice names, as a user would copy it: docker's --shm-size and
# --memory, compose's shm_size and mem_limit, a Kubernetes sizeLimit or memory limit.
ADVISED = re.compile(r"(?:--shm-size=|--memory=|shm_size: |mem_limit: |sizeLimit: |memory=|\"sizeLimit\":\")(\w+)")
REQUIREMENTS = st.one_of(
    st.integers(1, 1 << 50),
    st.builds(lambda n, p: n * 1000**p, st.integers(1, 999_999), st.integers(0, 4)),  # 16G, 300M
    st.builds(lambda n, p: n * 1024**p, st.integers(1, 999_999), st.integers(0, 4)),  # 16Gi, 2g
    st.builds(lambda n, p: parse_size(f"{n / 10}{p}"), st.integers(1, 99_999), st.sampled_from("KMGTkmgt")),
)


@settings(max_examples=500, deadline=None, database=None)
@given(REQUIREMENTS, st.integers(0, 1 << 40))
@example(16_000_000_000, 0)  # --require-shm 16G once advised 15258Mi: 15,999,172,608 bytes
def test_advice_is_never_below_the_requirement(required, other_use):
    assert round_up(required) >= required
    for text in (*quantities(required), at_least(required).replace(" ", "")):
        assert parse_size(text) >= required, text
    assert parse_size(at_most(required).replace(" ", "")) <= required
    limit = memory_limit_needed(round_up(required), other_use + 5, 5)
    assert limit >= other_use + round_up(required)
    remedy = shm_remedy(required)
    advice = " ".join([remedy, *settings_for(round_up(required), "dshm", limit).values()])
    sizes = ADVISED.findall(advice)
    assert len(sizes) == 10, advice  # 3 in the remedy; 4 shm and 3 memory settings
    assert all(parse_size(s) >= required for s in sizes), advice


@needs_root
def test_require_16g_decimal_is_advised_at_least_16g():
    with mounted_tmpfs("8m") as shm:
        result = check(f"--shm.mount={shm}", "--require-shm", "16G")
    assert result.returncode == 2, result.stdout + result.stderr
    remedy = next(line for line in result.stdout.splitlines() if "sizeLimit" in line)
    assert "--shm-size=15g" in remedy and "sizeLimit: 15Gi" in remedy, remedy  # was sizeLimit: 15258Mi
    assert all(parse_size(s) >= 16_000_000_000 for s in ADVISED.findall(remedy))


def test_usage_errors_are_64_not_2():
    assert check("--recommend", "--recommend.window", "a week").returncode == 64
    assert check("--recommend", "--recommend.headroom", "0.5").returncode == 64
    assert check("--no-such-flag").returncode == 64
    assert check("--require-shm", "lots").returncode == 64
    assert check("--backend", "tgi").returncode == 64
    assert check("--log", "/nonexistent/server.log").returncode == 64


# Sample lines in the real formats (sources cited in exporter/check/signatures.yml).
SAMPLES = {
    "nccl_shm_create": "node1:9621:9688 [3] misc/shmutils.cc:132 NCCL WARN Error while creating shared memory "
                       "segment /dev/shm/nccl-KWfVyt (size 9637888), error: No space left on device (28)",
    "nccl_shm_extend": "node1:9621:9691 [6] misc/shmutils.cc:88 NCCL WARN Error: failed to extend "
                       "/dev/shm/nccl-fjwOOB to 9637892 bytes, error: No space left on device (28)",
    "ucx_shmget": "[1693920302.521306] [node1:15407:0] sys.c:915 UCX ERROR shmget(size=134221824 flags=0x7b0) for "
                  "mm_recv_desc failed: No space left on device, please check shared memory limits by 'ipcs -l'",
    "ucx_posix": "[1475682365.444036] [pod9:11912:0] mm_posix.c:88 UCX ERROR Not enough memory to write total of "
                 "4208440835 bytes. Please check that /dev/shm or the directory you specified has more available memory.",
    "shm_alloc": "ERROR 2026-11-30 12:00:01 Failed to allocate shared memory for the input tensor",
    "vllm_insufficient_shm": "RuntimeError: Insufficient space in /dev/shm: 12.0 MiB free, 64.0 MiB needed",
    "bus_error": "ERROR: Unexpected bus error encountered in worker. This might be caused by insufficient shared "
                 "memory (shm).",
    "cuda_oom": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
                "of 79.10 GiB of which 1.02 GiB is free.",
    "leaked_shared_memory": "/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: "
                            "resource_tracker: There appear to be 3 leaked shared_memory objects to clean up at shutdown",
    # The engines' lines as operators paste them (issue 32), exactly.
    "vllm_shm_required": "RuntimeError: Insufficient space in /dev/shm: 160 MiB required, 64 MiB free. "
                         "Increase /dev/shm (e.g. --shm-size or --ipc=host).",
    "vllm_broadcast_block": "No available shared memory broadcast block found in 60 seconds",
    "vllm_engine_dead": "EngineDeadError: EngineCore encountered an issue",
    "sglang_scheduler_died": "RuntimeError: Rank 0 scheduler died during initialization (exit code: -7)",
    "nccl_cumem_mismatch": "Error while attaching to shared memory segment /dev/shm/nccl-XXXX (size 0)",
    "ray_object_store": "store_runner.cc:83: System memory request exceeds memory available in /dev/shm",
    "emptydir_evicted": 'Usage of EmptyDir volume "dshm" exceeds the limit "1Gi".',
}

# Each pasted line -> the signatures it must hit (a Bus error line hits bus_error alone).
PASTED = {
    "Fatal Python error: Bus error": {"bus_error"},
    "The configured object store size (10 GB) exceeds /dev/shm size (2 GB). This will harm performance.":
        {"ray_object_store"},
    "node1:9621:9688 [3] misc/shmutils.cc:132 NCCL WARN Error while attaching to shared memory segment "
    "/dev/shm/nccl-AbCdEf (size 0)": {"nccl_cumem_mismatch"},
    **{line: {name} for name, line in SAMPLES.items()},
}


def test_pasted_lines_hit_their_signature_and_figures_reach_the_finding(tmp_path):
    from exporter.check.logscan import scan_log
    for n, (line, expected) in enumerate(PASTED.items()):
        log = tmp_path / f"{n}.log"
        log.write_text(f"INFO before\n{line}\nINFO after\n")
        assert set(scan_log(str(log)).hits) == expected, line
    log = tmp_path / "engines.log"
    log.write_text("\n".join(PASTED))
    result = check("--shm.mount=/dev/shm", f"--log={log}", "--output", "json")
    text = {f["message"].split(" Seen: ")[0]: f["remedy"] for f in json.loads(result.stdout)["findings"]
            if f["area"] == "log"}
    assert "vLLM's shared-memory queue needs 160.0 MiB in /dev/shm and found 64.0 MiB free" in " ".join(text)
    assert any("more than 160.0 MiB" in r for r in text.values())
    assert any("rank 0 scheduler" in t and "exit code -7" in t for t in text)
    assert any("emptyDir dshm grew past its sizeLimit 1Gi" in t for t in text)
    assert any("60 s" in t for t in text)


def test_every_signature_holds_a_needle_and_fits_the_window():
    # Only text near a needle is matched: a signature whose match holds none never matches,
    # and one whose quantifiers are unbounded can backtrack over a whole line (a ReDoS).
    import re._parser
    from exporter.check.logscan import NEEDLES, PATTERNS, TABLE, WINDOW
    for line, names in PASTED.items():
        for name, pattern in PATTERNS:
            if name in names:
                match = pattern.search(line).group(0).lower()
                assert any(n in match for n in TABLE[name]["needles"]), (name, line)
    for name, said in TABLE.items():
        widest = re._parser.parse(said["regex"]).getwidth()[1]
        assert widest + max(map(len, NEEDLES)) + 16 <= WINDOW // 2, (name, widest)


def test_the_package_data_pip_installs_holds_every_file_the_package_reads():
    # A non-editable install (the image, tests/system/test_floors.py) carries only the data files
    # pyproject.toml names: the signature table among them.
    import tomllib
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        named = tomllib.load(f)["tool"]["setuptools"]["package-data"]
    for root, _, files in os.walk(os.path.join(REPO, "exporter")):
        package = os.path.relpath(root, REPO).replace(os.sep, ".")
        for name in files:
            if not name.endswith((".py", ".pyc")):
                assert name in named.get(package, []), f"{package}/{name} is not in package-data"


def test_hits_far_apart_on_a_long_line_and_on_the_next_are_found(tmp_path):
    from exporter.check.logscan import scan_log
    log = tmp_path / "server.log"
    filler = "x" * 5000
    lines = [f"{SAMPLES['cuda_oom']} {filler} {SAMPLES['emptydir_evicted']} {filler} Bus error",
             "Fatal Python error: Bus error", SAMPLES["ray_object_store"]]
    log.write_text("\n".join(lines) + "\n")
    hits = scan_log(str(log)).hits
    assert set(hits) == {"cuda_oom", "bus_error", "emptydir_evicted", "ray_object_store"}
    assert hits["emptydir_evicted"].fields == {"volume": "dshm", "limit": "1Gi"}
    assert hits["bus_error"].text.endswith("[2 matching line(s)]"), hits["bus_error"]


def test_log_signatures(tmp_path):
    from exporter.check.logscan import TABLE, scan_log
    assert set(SAMPLES) == set(TABLE) and all(set(said) == {"needles", "regex", "explanation", "remedy"}
                                             for said in TABLE.values())
    log = tmp_path / "server.log"
    log.write_text("INFO starting\n" + "\n".join(SAMPLES.values()) + "\nINFO fine\n")
    hits = scan_log(str(log)).hits
    assert set(hits) == set(SAMPLES)
    assert hits["ucx_shmget"].line == 4
    result = check("--shm.mount=/dev/shm", f"--log={log}", "--output", "json")
    logs = [f for f in json.loads(result.stdout)["findings"] if f["area"] == "log"]
    assert len(logs) == len(SAMPLES) and all(f["remedy"] for f in logs)
    assert result.returncode >= 1


def test_logs_are_read_after_the_collectors(tmp_path, capsys):
    # A scan's regexes hold the GIL: run alongside the collectors, a long log slowed them past
    # their timeouts. A line written as the collectors finish is there for the scan to read.
    from exporter.check.report import main
    from exporter.cli import collect_once
    log = tmp_path / "server.log"
    log.write_text("INFO starting\n")

    def collect(cfg, timeout):
        model = collect_once(cfg, timeout)
        with open(log, "a") as f:
            f.write(SAMPLES["cuda_oom"] + "\n")
        return model

    assert main(["--no-collector.gpu", "--shm.mount=/dev/shm", f"--log={log}"], collect) >= 1
    assert "The GPU ran out of memory" in capsys.readouterr().out


def test_large_logs_are_streamed(tmp_path):
    log = tmp_path / "big.log"
    line = ("INFO 2026-11-30 12:00:00 engine step: batch of 64 requests, 4096 tokens, all fine " * 3 + "\n").encode()
    with open(log, "wb") as f:
        for _ in range(20):
            f.write(line * 40000)  # 20 x ~10 MB
        f.write((SAMPLES["nccl_shm_create"] + "\n").encode())
    size = os.path.getsize(log)
    with open(tmp_path / "out", "w+") as out:
        subprocess.run([sys.executable, "-c", MEASURE, sys.executable, "-m", "exporter", "check",
                        "--no-collector.gpu", "--shm.mount=/dev/shm", f"--log={log}", "--no-collector.segments"],
                       cwd=REPO, stdout=out, stderr=subprocess.STDOUT, timeout=600)
        out.seek(0)
        stdout = out.read()
    peak = peak_rss(stdout)
    assert "NCCL could not create" in stdout
    print(f"\nscanned {size / 2**20:.0f} MiB of log; check's peak RSS {peak / 2**20:.0f} MiB")
    assert size > 150 << 20
    # About 35 MiB here; reading the log whole would need more than its 188 MiB.
    assert peak < 100 << 20, f"peak RSS {peak >> 20} MiB for {size >> 20} MiB of log: not streamed"



@needs_root
def test_limit_flag_at_host_memory_is_named_as_no_limit():
    """The Downward API gives a container without a memory limit the node's memory: check says
    the flag was taken as no limit instead of calling the pod safe."""
    with mounted_tmpfs("16m") as shm:
        huge = check(f"--shm.mount={shm}", "--memory.limit-bytes", str(1 << 50), "--output", "json")
        fine = check(f"--shm.mount={shm}", "--memory.limit-bytes", str(1 << 30), "--output", "json")
    found = [f for f in json.loads(huge.stdout)["findings"] if f["subject"] == "--memory.limit-bytes"]
    assert found and found[0]["severity"] == "warn" and "no limit given" in found[0]["message"], huge.stdout
    assert not [f for f in json.loads(fine.stdout)["findings"] if f["subject"] == "--memory.limit-bytes"]
