"""kernel.sysv's advice: prose that names the commands, nothing that pastes into a shell as
redirections (`ipcrm -m <id>` read a file `id` and wrote one named `for`)."""
from exporter.check.findings import Report
from exporter.check.kernel import sysv
from exporter.model.types import SysvSegment, SysvShm

ORPHAN = SysvSegment(key=0, shmid=7, size_bytes=4096, nattch=0, cpid=1, rss_bytes=0, orphan=True)


def remedies(ns):
    report = Report()
    sysv(report, [ns], False)
    return [f.remedy for f in report.findings]


def test_sysv_advice_is_prose_without_shell_metacharacters():
    ok = remedies(SysvShm([ORPHAN], 1 << 40, 1 << 40, 4096))
    near = remedies(SysvShm([ORPHAN] * 4, 1 << 40, 1 << 40, 4))
    assert ok == ["remove orphans (list them with ipcs -m, remove each with ipcrm -m ID)"]
    assert near == ["remove orphans (list them with ipcs -m, remove each with ipcrm -m ID) or raise the limit: "
                    "sysctl -w kernel.shmmni=8192"]
    assert not any(c in r for r in ok + near for c in "<>;|&$`")
