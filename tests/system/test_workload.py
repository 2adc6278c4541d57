"""The sidecar's workload: cgroup paths through mounts (cAdvisor's root stripping) and the
smaps_rollup parser, on text; the whole estimate runs for real in tests/containers/test_memory.py."""

from exporter.host.proctable import parse_meminfo as parse_smaps_rollup


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
