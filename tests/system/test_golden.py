"""End-to-end on fixtures, node_exporter style: the binary's /metrics diffed against a golden file.

The fixture procfs/sysfs are checked in (tests/fixtures); the shm mount is a real
16 MiB tmpfs under a temporary --path.rootfs (statvfs has to be real), holding files
of known sizes; a fixture process 4242 'maps' them, with the tmpfs's real device and
inode numbers filled into tests/fixtures/proc_pid_template/maps.

Rewrite the golden file after an intended change:

    SHMWATCH_UPDATE_GOLDEN=1 python3 -m pytest tests/system/test_golden.py
"""
import os
import re
import shutil
import time

from tests.conftest import FIXTURES, Exporter, fallocate, mounted_tmpfs, needs_root, promtool_check_metrics

GOLDEN = os.path.join(FIXTURES, "golden.prom")
# Values that depend on the clock or on this process, not on the fixtures.
VOLATILE = re.compile(r"^(shmwatch_collector_duration_seconds|shmwatch_orphan_oldest_age_seconds|"
                      r"shmwatch_mount_max_used_timestamp_seconds|process_)")
MiB = 1 << 20


def normalise(text: str) -> str:
    lines = []
    for line in text.splitlines():
        if not line.startswith("#") and VOLATILE.match(line):
            line = line.rsplit(" ", 1)[0] + " <volatile>"
        lines.append(line)
    return "\n".join(lines) + "\n"


@needs_root
def test_golden_exposition(tmp_path):
    proc = tmp_path / "proc"
    shutil.copytree(os.path.join(FIXTURES, "proc"), proc)
    with open(proc / "self" / "mountinfo", "a") as f:  # the copy is a procfs that hides no pid
        f.write(f"28 22 0:21 / {os.path.realpath(proc)} rw - proc proc rw\n")
    rootfs = tmp_path / "rootfs"
    with mounted_tmpfs("16m", path=str(rootfs / "dev" / "shm"), options=",nr_inodes=1000") as shm:
        fallocate(os.path.join(shm, "nccl-Gold3n"), 4 * MiB)
        fallocate(os.path.join(shm, "psm_0rphan"), MiB)
        fallocate(os.path.join(shm, "sem.mp-golden"), 4096)
        fallocate(os.path.join(shm, "nccl-h1dden"), MiB)
        # Named (shmwatch_top_segment_bytes): last modified an hour ago. sem.mp-golden is not.
        hour_ago = time.time() - 3600
        for name in ("nccl-Gold3n", "psm_0rphan"):
            os.utime(os.path.join(shm, name), (hour_ago, hour_ago))
        held = os.open(os.path.join(shm, "nccl-h1dden"), os.O_RDONLY)  # keeps the unlinked inode alive
        os.unlink(os.path.join(shm, "nccl-h1dden"))
        try:
            st = os.stat(shm)
            ino = {name: os.stat(os.path.join(shm, name)).st_ino for name in ("nccl-Gold3n", "sem.mp-golden")}
            pid_dir = proc / "4242"
            pid_dir.mkdir()
            template = os.path.join(FIXTURES, "proc_pid_template")
            shutil.copy(os.path.join(template, "stat"), pid_dir / "stat")
            with open(os.path.join(template, "maps")) as f:
                maps = f.read().format(DEV="%02x:%02x" % (os.major(st.st_dev), os.minor(st.st_dev)),
                                       INO_NCCL=ino["nccl-Gold3n"], INO_HIDDEN=os.fstat(held).st_ino,
                                       INO_SEM=ino["sem.mp-golden"])
            (pid_dir / "maps").write_text(maps)
            with Exporter(f"--path.procfs={proc}", f"--path.sysfs={os.path.join(FIXTURES, 'sys')}",
                          f"--path.rootfs={rootfs}", "--shm.mount=/dev/shm", "--no-collector.gpu",
                          "--shm.size-limit=16Mi") as exporter:
                text = exporter.scrape_text()
        finally:
            os.close(held)
    result = promtool_check_metrics(text)
    assert result.returncode == 0, result.stdout + result.stderr
    got = normalise(text)
    with open(GOLDEN) as f:
        want = f.read()  # read before any rewrite: the comparison is always against the old file
    if got != want and os.environ.get("SHMWATCH_UPDATE_GOLDEN"):
        with open(GOLDEN, "w") as f:
            f.write(got)
        changed = sum(1 for a, b in zip(got.splitlines(), want.splitlines()) if a != b)
        changed += abs(len(got.splitlines()) - len(want.splitlines()))
        assert False, f"tests/fixtures/golden.prom rewritten ({changed} lines differ): review `git diff`, rerun"
    assert got == want, "exposition differs from tests/fixtures/golden.prom (SHMWATCH_UPDATE_GOLDEN=1 rewrites it)"
