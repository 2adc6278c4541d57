# mypy: allow-untyped-calls
"""`shmwatch check` end to end through its main(): flags, the one collection it asks for and
within what time, the findings and their exit code (the verdict an initContainer acts on),
text or JSON, the logs, the memory-limit flag at the host's size, and a bug reported as one.
The collection is a model built by hand; /proc a fixture tree. Part of the mutation selection.
Then a mount's segment findings: leaked bytes as tmpfs charges them, unverified segments, and
the `rm` advice for leaked files with hard links, word for word (report.shm with the names
names.leaked_names found): every name of a file in one `rm --`, or none and why."""

import json
import os
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import pytest

from exporter.check.findings import Report
from exporter.check.names import Names
from exporter.check.report import diagnose, main, shm
from exporter.model.state import MountStates
from exporter.model.step import Model, MountView, SourceStatus
from exporter.model.summary import shm_budget
from exporter.config import Config
from exporter.model.summary import SegmentSummary, summarise
from exporter.model.types import (
    CgroupMemory,
    HostMemory,
    Inventory,
    MountInventory,
    MountUsage,
)
from tests.helpers import inventory, seg, usage, view

MiB, GiB = 1 << 20, 1 << 30
Listed = Tuple[
    str, str, str, int, int
]  # a listed segment: name, class, state, allocated, apparent
NO_STATES = MountStates({}, {}, {}, {}, {})


class Collect:
    """check's one run of every source: the model it hands back, and what it was asked."""

    def __init__(
        self, model: Optional[Model] = None, error: Optional[Exception] = None
    ) -> None:
        self.model, self.error = model, error
        self.timeouts: List[float] = []
        self.cfgs: List[Config] = []

    def __call__(self, cfg: Config, timeout: float) -> Model:
        self.cfgs.append(cfg)
        self.timeouts.append(timeout)
        if self.error:
            raise self.error
        assert self.model is not None
        return self.model


def shm_model(
    size: int,
    used: int = 0,
    cgroup: Optional[CgroupMemory] = None,
    host: Optional[HostMemory] = None,
    statuses: Sequence[SourceStatus] = (),
) -> Model:
    usage = MountUsage(
        "/dev/shm",
        "tmpfs",
        "shm",
        True,
        size_bytes=size,
        used_bytes=used,
        available_bytes=size - used,
    )
    view = MountView(
        "/dev/shm",
        {},
        usage,
        None,
        None,
        None,
        None,
        None,
        cgroup,
        shm_budget(usage, cgroup),
    )
    return Model(
        False,
        list(statuses),
        [view],
        None,
        [cgroup] if cgroup else [],
        host,
        [],
        None,
        [],
        NO_STATES,
    )


@pytest.fixture
def proc(tmp_path: Path) -> List[str]:
    """Paths flags to an empty /proc (no NCCL user is looked for in the real one)."""
    (tmp_path / "proc").mkdir()
    return [f"--path.procfs={tmp_path / 'proc'}", f"--path.sysfs={tmp_path / 'sys'}"]


def run(
    capsys: pytest.CaptureFixture[str], argv: List[str], collect: Collect
) -> Tuple[int, str, str]:
    code = main(argv, collect)
    out, err = capsys.readouterr()
    return code, out, err


def test_a_backend_needs_more_than_the_requirement_asks(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    """--require-shm 1Gi --backend vllm on a 4 GiB mount: the requirement holds, vLLM's 16 GiB
    does not: a warning, exit 1 (the issue's planted bug: skipped, exit 0)."""
    code, out, _ = run(
        capsys,
        [*proc, "--require-shm", "1Gi", "--backend", "vllm", "--output", "json"],
        Collect(shm_model(4 * GiB)),
    )
    doc = json.loads(out)
    assert (code, doc["status"], doc["exit_code"]) == (1, "warn", 1)
    [warn] = [f for f in doc["findings"] if f["severity"] == "warn"]
    assert (
        warn["message"] == "can hold 4.0 GiB, under the 16.0 GiB recommended for vllm"
    )
    code, out, _ = run(
        capsys,
        [*proc, "--require-shm", "16Gi", "--backend", "vllm"],
        Collect(shm_model(4 * GiB)),
    )
    assert (
        code == 2 and "recommended for vllm" not in out
    )  # the requirement says it: once
    assert (
        run(capsys, [*proc, "--backend", "trtllm"], Collect(shm_model(80 * GiB)))[0]
        == 0
    )


def test_text_output_worst_first(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    code, out, err = run(
        capsys,
        [*proc, "--require-shm", "128Mi"],
        Collect(shm_model(64 * MiB, 62 * MiB)),
    )
    assert code == 2 and err == ""
    lines = out.splitlines()
    assert lines[0].endswith(": 2 problem(s), worst first")
    assert (
        lines[3].startswith("FAIL   shm     /dev/shm")
        and "below the 128.0 MiB required" in lines[3]
    )
    assert lines[4].lstrip().startswith("-> docker run --shm-size=128m")
    assert lines[5].startswith("FAIL   shm     /dev/shm") and lines[5].endswith(
        "(97%): about to be full"
    )


def test_the_collection_gets_the_time_left(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    collect = Collect(shm_model(GiB))
    run(capsys, proc, collect)
    run(
        capsys, [*proc, "--collector.timeout=2s", "--collector.gpu.timeout=3s"], collect
    )
    run(capsys, [*proc, "--timeout", "1.5"], collect)
    (default, shorter, bounded) = collect.timeouts
    assert 10.0 < default <= 11.0  # the slowest collector's timeout and a second
    assert 3.0 < shorter <= 4.0
    assert 1.0 < bounded <= 1.5  # --timeout bounds the whole check
    assert collect.cfgs[0].procfs.endswith("/proc")


@pytest.mark.parametrize(
    "argv",
    [
        ["--require-shm", "banana"],
        ["--backend", "tgi"],
        ["--no-such-flag"],
        ["--timeout", "0"],
        ["--timeout", "inf"],
        ["--output", "yaml"],
        ["--require-shm", "2P"],
    ],
)
def test_a_usage_error_is_64_not_a_verdict(
    capsys: pytest.CaptureFixture[str], proc: List[str], argv: List[str]
) -> None:
    collect = Collect(shm_model(GiB))
    with pytest.raises(SystemExit) as raised:
        main([*proc, *argv], collect)
    assert raised.value.code == 64 and collect.timeouts == []


def test_help_is_no_error(capsys: pytest.CaptureFixture[str], proc: List[str]) -> None:
    with pytest.raises(SystemExit) as raised:
        main([*proc, "--help"], Collect(shm_model(GiB)))
    out = " ".join(capsys.readouterr().out.split())
    assert raised.value.code == 0 and out.startswith("usage: shmwatch check ")
    assert (
        "--require-shm REQUIRE_SHM Fail (exit 2) when the shm mount can hold less than this, e.g. 16Gi."
        in out
    )


def test_a_bad_value_is_named_with_its_flag(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    for argv, said in (
        (
            ["--timeout", "0"],
            "argument --timeout: not a number of seconds above 0: '0'",
        ),
        (
            ["--require-shm", "2P"],
            "argument --require-shm: 2000000000000000 is not a plausible size (0 to 1 PiB)",
        ),
    ):
        with pytest.raises(SystemExit):
            main([*proc, *argv], Collect(shm_model(GiB)))
        assert said in capsys.readouterr().err


def test_a_short_timeout_is_a_timeout(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    collect = Collect(shm_model(GiB))
    assert run(capsys, [*proc, "--timeout", "0.5"], collect)[0] == 0
    assert 0 < collect.timeouts[0] <= 0.5


def test_nccl_in_cumem_host_memory_is_looked_for_in_the_proc_given(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    from tests.helpers import FakeProc, maps_line

    fake = FakeProc(str(tmp_path / "proc"))
    fake.add(
        10, "vllm", maps=maps_line(0x1000, 0x2000, 0x801, 7, "/usr/lib/libnccl.so.2")
    )
    fake.write("10/environ", "PATH=/bin\0")
    model = replace(shm_model(GiB), inventory=Inventory([], {}, 0, 1))
    code, out, _ = run(
        capsys, [f"--path.procfs={fake.root}", "--output=json"], Collect(model)
    )
    [nccl] = [f for f in json.loads(out)["findings"] if f["subject"] == "nccl"]
    assert code == 0 and nccl["message"].startswith(
        "NCCL is loaded (vllm[10]) and no nccl-* segment exists"
    )


def test_a_log_that_cannot_be_read_is_a_usage_error(
    capsys: pytest.CaptureFixture[str], proc: List[str], tmp_path: Path
) -> None:
    collect = Collect(shm_model(GiB))
    code, out, err = run(capsys, [*proc, "--log", str(tmp_path / "none.log")], collect)
    assert code == 64 and out == "" and collect.timeouts == []
    assert (
        err
        == f"shmwatch check: error: argument --log: {tmp_path / 'none.log'}: cannot read it: No such file or directory\n"
    )
    code, _, err = run(capsys, [*proc, "--log", str(tmp_path)], collect)
    assert code == 64 and err.endswith(f"{tmp_path}: not a regular file\n")


def test_a_logs_failure_lines_are_findings(
    capsys: pytest.CaptureFixture[str], proc: List[str], tmp_path: Path
) -> None:
    log = tmp_path / "vllm.log"
    log.write_text(
        "INFO start\nRuntimeError: Insufficient space in /dev/shm: 64 MiB required, 12 MiB free\n"
    )
    code, out, _ = run(
        capsys, [*proc, "--log", str(log), "--output", "json"], Collect(shm_model(GiB))
    )
    doc = json.loads(out)
    assert code == 1 and [
        f["area"] for f in doc["findings"] if f["severity"] == "warn"
    ] == ["log"]


def test_a_memory_limit_flag_at_the_hosts_size_is_taken_as_none(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    host = HostMemory(64 * GiB, 32 * GiB, 0)
    code, out, _ = run(
        capsys,
        [*proc, "--memory.limit-bytes=64Gi", "--output=json"],
        Collect(shm_model(GiB, host=host)),
    )
    [warn] = [f for f in json.loads(out)["findings"] if f["severity"] == "warn"]
    assert (code, warn["area"], warn["subject"], warn["message"]) == (
        1,
        "memory",
        "--memory.limit-bytes",
        "64.0 GiB is at or above the host's memory: taken as no limit given",
    )
    assert (
        warn["remedy"]
        == "a container without a memory limit gets the node's memory from the Downward API"
    )
    below = run(
        capsys, [*proc, "--memory.limit-bytes=63Gi"], Collect(shm_model(GiB, host=host))
    )
    assert below[0] == 0 and "--memory.limit-bytes" not in below[1]
    assert (
        run(capsys, [*proc, "--memory.limit-bytes=64Gi"], Collect(shm_model(GiB)))[0]
        == 0
    )  # host unread


def test_recommend_appends_the_sizes_and_their_settings(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    cg = CgroupMemory("/c", 2, 400 * MiB, 400 * MiB, 390 * MiB, None, 0, "self")
    code, out, _ = run(
        capsys, [*proc, "--recommend"], Collect(shm_model(256 * MiB, 60 * MiB, cg))
    )
    assert (
        "\nRECOMMENDATIONS (highest observed peak x 1.25, rounded up to a whole GiB, MiB below 1 GiB)\n"
        in out
    )
    assert "/dev/shm: observed peak 60.0 MiB (" in out and "recommended 75.0 MiB" in out
    assert code == 1  # the limit cannot hold it: a warning
    code, out, _ = run(
        capsys, [*proc, "--output=json"], Collect(shm_model(256 * MiB, 60 * MiB, cg))
    )
    assert "RECOMMENDATIONS" not in out and json.loads(out)["recommendations"] == []


def test_a_bug_in_check_is_70_and_asks_for_a_report(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    code, out, err = run(capsys, proc, Collect(error=RuntimeError("boom")))
    assert (code, out) == (70, "")
    assert (
        err.endswith(
            "shmwatch check: internal error (RuntimeError), please report it\n"
        )
        and "boom" in err
    )


def test_collectors_that_failed_are_named(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    failed = [
        SourceStatus("sysv", False, 0.0, "EPERM"),
        SourceStatus("gpu", False, 0.0, "no driver"),
    ]
    code, out, _ = run(
        capsys, [*proc, "--output=json"], Collect(shm_model(GiB, statuses=failed))
    )
    findings = {
        (f["severity"], f["area"], f["subject"]) for f in json.loads(out)["findings"]
    }
    assert ("warn", "sysv", "collector sysv") in findings and (
        "info",
        "gpu",
        "NVML",
    ) in findings
    assert code == 1


def test_no_nccl_in_this_proc_no_nccl_finding(
    capsys: pytest.CaptureFixture[str], proc: List[str]
) -> None:
    code, out, _ = run(capsys, proc, Collect(shm_model(GiB)))
    assert code == 0 and "nccl" not in out.lower()
    assert out.endswith("1.0 GiB, 0 B used (0%)\n")  # the table, and nothing after it
    assert os.listdir(proc[0].split("=", 1)[1]) == []


def mount_with(
    segments: List[Listed],
) -> Tuple[MountUsage, MountInventory, SegmentSummary]:
    """(usage, inventory, summary) of a 1 GiB mount listing `segments`:
    (name, class, state, allocated, apparent)."""
    from exporter.model.classes import CLASS_NAMES
    from exporter.model.summary import summarise
    from exporter.model.types import STATES, Row

    rows = [
        Row.pack(
            CLASS_NAMES.index(cls),
            inode=ino,
            mtime=0,
            blocks=allocated // 512,
            apparent_bytes=apparent,
        )
        for ino, (_, cls, _, allocated, apparent) in enumerate(segments, 1)
    ]
    inv = MountInventory(
        "/dev/shm",
        names=tuple(name for name, *_ in segments),
        packed=tuple(rows),
        states=bytes(STATES.index(state) for _, _, state, _, _ in segments),
    )
    usage = MountUsage(
        "/dev/shm",
        "tmpfs",
        "shm",
        True,
        size_bytes=GiB,
        used_bytes=8 * MiB,
        available_bytes=GiB - 8 * MiB,
    )
    return usage, inv, summarise(inv, 5)


def report_of(segments: List[Listed]) -> List[Tuple[str, str]]:
    usage, inv, summary = mount_with(segments)
    view = MountView(
        "/dev/shm",
        {},
        usage,
        None,
        None,
        None,
        inv,
        summary,
        None,
        shm_budget(usage, None),
    )
    model = Model(
        False,
        [],
        [view],
        Inventory([inv], {}, 0, 1, wall_time=0.0),
        [],
        None,
        [],
        None,
        [],
        NO_STATES,
    )
    report = Report()
    shm(report, view, model, None)
    return [(f.severity, f.message) for f in report.findings]


def test_leaked_bytes_are_what_tmpfs_charges_not_the_size_asked() -> None:
    found = report_of([("psm_sparse", "python_shm", "orphan", MiB, 64 * MiB)])
    assert (
        "warn",
        "1 leaked segment(s) held by no process, 1.0 MiB: /dev/shm/psm_sparse",
    ) in found


def test_unverified_segments_are_said_when_nothing_is_leaked() -> None:
    found = report_of([("psm_live", "python_shm", "unverified", MiB, MiB)])
    assert [s for s, _ in found] == ["ok", "info"]
    assert found[1][1].startswith(
        "1 segment(s), 1.0 MiB, held by no process shmwatch could inspect"
    )


CALM = "once no server can attach to them"


def remedy(names: List[str], links: Dict[int, Names]) -> str:
    """The remedy of the leaked-files finding of /m holding nccl-* orphans `names` (inodes 1, 2,
    ...) given `links`: inode -> Names."""
    inv = inventory("/m", [seg(n, "nccl", "orphan", MiB) for n in names])
    u = usage(GiB, 0, "/m")
    v = MountView("/m", {}, u, None, None, None, inv, summarise(inv, 5), None, view(u).budget)
    report = Report()
    shm(report, v, SimpleNamespace(  # type: ignore[arg-type]
        inventory=Inventory([], {}, 0, 1)), None, {(0, i): n for i, n in links.items()})
    [leaked] = [f for f in report.findings if "leaked" in f.message]
    return leaked.remedy


def test_a_file_with_several_names_is_removed_by_all_of_them() -> None:
    links = {1: Names(("nccl-a", "sub/nccl-b", "nccl-c d"), 3), 2: Names(("nccl-z",), 1)}
    assert remedy(["nccl-a", "nccl-z"], links) == (
        f"{CALM} (/m/nccl-a has 3 names, all removed): rm -- /m/nccl-a /m/sub/nccl-b '/m/nccl-c d' /m/nccl-z")


def test_a_file_with_a_name_not_found_or_gone_is_left_out_and_said() -> None:
    links = {1: Names(("nccl-a",), 2), 2: Names(("nccl-z",), 1), 3: Names((), 0)}
    assert remedy(["nccl-a", "nccl-z", "nccl-y"], links) == (
        f"{CALM} (/m/nccl-a has 2 names, 1 not found below /m: removing the others frees nothing; "
        "/m/nccl-y is gone or another file since listed): rm -- /m/nccl-z")
    assert remedy(["nccl-a"], {1: Names(("nccl-a", "x/nccl-b"), 3)}) == (
        "/m/nccl-a has 3 names, 1 not found below /m: removing the others frees nothing")  # no rm at all


def test_a_file_also_named_as_another_class_is_not_advised_away() -> None:
    assert remedy(["nccl-a", "nccl-\x1b"], {1: Names(("lock", "nccl-a"), 2), 2: Names(("nccl-\x1b",), 1)}) == (
        f"{CALM} (/m/nccl-a is also lock, of no class shmwatch removes): rm -- $'/m/nccl-\\x1b'")


def test_without_the_names_looked_up_each_is_removed_by_its_listed_name() -> None:
    assert remedy(["nccl-a", "nccl-$(id)"], {}) == f"{CALM}: rm -- '/m/nccl-$(id)' /m/nccl-a"


def test_diagnose_hands_the_names_looked_up_to_each_mounts_advice() -> None:
    # check's main looks the leaked files' names up once (names.leaked_names) and diagnose
    # passes them down to the rm advice of the mount that lists them.
    inv = inventory("/m", [seg("nccl-a", "nccl", "orphan", MiB)])
    u = usage(GiB, 0, "/m")
    v = MountView("/m", {}, u, None, None, None, inv, summarise(inv, 5), None, view(u).budget)
    model = Model(node_mode=False, statuses=[], mounts=[v], inventory=Inventory([], {}, 0, 1), cgroups=[],
                  host_memory=None, sysv=[], gpu=None, process_samples=[], states=NO_STATES)
    report = diagnose(model, links={(0, 1): Names(found=("nccl-a", "sub/nccl-b"), links=2)})
    [leaked] = [f for f in report.findings if "leaked" in f.message]
    assert leaked.remedy == f"{CALM} (/m/nccl-a has 2 names, all removed): rm -- /m/nccl-a /m/sub/nccl-b"
