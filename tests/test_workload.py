"""The sidecar's workload: cgroup paths through mounts (cAdvisor's root stripping) and the
smaps_rollup parser, on text; the whole estimate runs for real in tests/containers/test_memory.py."""
from exporter.host.cgroupfs import below, cgroup_directories
from exporter.host.mountinfo import parse_mountinfo
from exporter.host.proctable import parse_meminfo as parse_smaps_rollup

# A Docker sidecar on cgroup v1: its own memory cgroup mounted at /sys/fs/cgroup/memory (root
# /docker/<sidecar>), and the host's cgroupfs given read-only at /host/sys/fs/cgroup.
MOUNTINFO_V1 = """\
600 590 0:30 /docker/sidecar /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
610 590 0:30 / /host/sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory
611 590 0:31 / /host/sys/fs/cgroup/cpu ro,nosuid - cgroup cgroup rw,cpu
"""
# cgroup v2 with a private cgroup namespace: the host's cgroupfs, seen from inside it, is
# rooted above the namespace (mountinfo shows /../..), and another container reads /../<id>.
MOUNTINFO_V2 = """\
700 690 0:40 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw
710 690 0:40 /../.. /host/sys/fs/cgroup ro - cgroup2 cgroup2 rw
"""


def test_the_workload_cgroup_is_found_under_the_mount_that_shows_it():
    entries = parse_mountinfo(MOUNTINFO_V1)
    assert cgroup_directories(entries, "/docker/server", 1) == ["/host/sys/fs/cgroup/memory/docker/server"]
    assert cgroup_directories(entries, "/docker/sidecar/x", 1) == ["/sys/fs/cgroup/memory/x",
                                                                   "/host/sys/fs/cgroup/memory/docker/sidecar/x"]
    assert cgroup_directories(entries, "/docker/server", 2) == []  # no v2 mount here


def test_paths_above_a_private_namespace_root():
    entries = parse_mountinfo(MOUNTINFO_V2)
    # A sibling of our namespace's root (/../docker-server.scope) under a mount rooted two
    # levels up (/../..): the directory in between has a name nobody here can tell, so no
    # directory is guessed (the sidecar estimates instead; --cgroupns=host makes paths whole).
    assert cgroup_directories(entries, "/../docker-server.scope", 2) == []
    assert below("/../a/b", "/..") == ["a", "b"]  # a mount rooted at the parent: the name is known
    assert below("/../docker-server.scope", "/") is None  # not under our namespace's root
    assert below("/a/b", "/a") == ["b"] and below("/a", "/a") == [] and below("/ab", "/a") is None


def test_smaps_rollup():
    text = ("55c4e09b0000-7fff6b3f9000 ---p 00000000 00:00 0   [rollup]\nRss:  1728 kB\nPss_Anon:   112 kB\n"
            "Pss_File:  58 kB\nPss_Shmem:  0 kB\nbogus line\n")
    assert parse_smaps_rollup(text) == {"Rss": 1728 << 10, "Pss_Anon": 112 << 10, "Pss_File": 58 << 10,
                                        "Pss_Shmem": 0}


def test_the_estimate_counts_file_pages_a_process_maps(tmp_path):
    """A workload that maps 48 MiB of a file on disk (weights, a tokenizer): its page cache is
    charged to its cgroup, so the estimate counts Pss_File beside Pss_Anon."""
    import subprocess
    import sys

    from exporter.host.paths import Paths
    from exporter.host.proctable import ProcessTable

    weights = tmp_path / "weights.bin"  # on the test's disk, not tmpfs: file pages, not shmem
    weights.write_bytes(b"\1" * (48 << 20))
    mapper = ("import mmap, sys\nf = open(sys.argv[1], 'rb')\nm = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)\n"
              "sum(m[i] for i in range(0, len(m), 4096))\nprint('ready', flush=True)\nsys.stdin.read()\n")
    proc = subprocess.Popen([sys.executable, "-c", mapper, str(weights)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        table = ProcessTable(Paths())
        [process] = table.identify_all([proc.pid], set()).processes
        rollup = parse_smaps_rollup(open(f"/proc/{proc.pid}/smaps_rollup").read())
        estimate = table.resident([process])
    finally:
        proc.stdin.close()
        proc.wait(10)
    assert rollup["Pss_File"] >= 40 << 20, rollup  # the mapped file, shared with nobody
    assert 48 << 20 <= estimate <= rollup["Pss_Anon"] + rollup["Pss_File"] + (4 << 20), (estimate, rollup)
