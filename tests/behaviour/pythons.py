"""The other Pythons shmwatch supports, each in a Debian root made with mmdebstrap: the fast
tier of the suite (FAST_TIER: no container, no VM, no tool beyond Python) runs in it, beside
the machine's own Python that runs everything.

No container engine: the root is a directory entered with chroot inside private mount and
PID namespaces (unshare), with its own /proc, /dev bound from the host, a tmpfs at /tmp, and
this checkout bound read-only at /src (pytest's cache off, bytecode not written, Hypothesis'
examples and every test's files under /tmp). The root, with the runtime and test
dependencies pip installed from the package index the host reaches (its extra CA
certificates and pip settings copied in, as tests/containers/engine.py does for the
container tier's base image), is made once, about a minute, and kept under /var/tmp in a
directory named by what went into it: a change of suite, packages or requirements makes a
new one (and removes the old).

By hand (root):  python3 -m tests.behaviour.pythons [--rebuild]
"""

import argparse
import fcntl
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from typing import List, Optional, Sequence

from tests.conftest import REPO
from tests.containers.engine import debian_sources, pip_conf_text, pip_settings


@dataclass(frozen=True)
class Python:
    version: str  # what `python3` is in the suite
    suite: str  # the Debian release that ships it


# Beside the machine's own Python (3.11, Debian bookworm's), which runs the whole suite.
OTHERS = (Python("3.13", "trixie"),)
CACHE = "/var/tmp"  # where roots are kept between runs, when it exists
PACKAGES = ("python3", "python3-pip", "ca-certificates")
# The tests that need nothing but Python and root: every unit test, the parsers (Hypothesis
# properties too), the decisions on fixture trees, the budget, config and docs tables, the
# package layout, the scheduler, and real serving (a shmwatch process, a tmpfs, scrapes) of
# fixture trees. Not the tests of real processes in namespaces and cgroups, nor of tools.
FAST_TIER = (
    "tests/unit",
    "tests/system/test_config.py",
    "tests/system/test_exposition.py",
    "tests/system/test_logs.py",
    "tests/system/test_budget.py",
    "tests/project/test_docs.py",
    "tests/project/test_layout.py",
)
# In those files, but needing what the root has not: run under the machine's Python only.
NOT_IN_ROOT = (
    "tests/system/test_exposition.py::test_real_prometheus_scrapes_openmetrics",  # Prometheus
    "tests/system/test_budget.py::test_v1_limit_is_the_tightest_up_the_tree_on_a_real_kernel",  # cgroups
    # pytest is pid 1 of the root's PID namespace: the pid it probes as hidden is itself.
    "tests/unit/host/test_proctable.py::test_hidepid_unknown_in_our_pid_namespace_probes_for_hidden_processes",
)
# Test dependencies the fast tier imports, by name: their bounds come from pyproject.toml.
TEST_DEPENDENCIES = (
    "pytest",
    "pytest-timeout",
    "hypothesis",
    "cryptography",
    "jsonschema",
)


def requirements() -> List[str]:
    """The runtime dependencies and the fast tier's test dependencies, as pyproject.toml
    bounds them."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]
    tests = [
        r
        for r in project["optional-dependencies"]["test"]
        if re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0] in TEST_DEPENDENCIES
    ]
    return [*project["dependencies"], *tests]


def debian_mirrors() -> List[str]:
    """The Debian archives this machine's apt uses (its security archive aside): a root of
    another suite comes from the same mirror."""
    uris: List[str] = []
    for path in debian_sources():
        with open(path, errors="replace") as f:
            for line in (raw.split("#", 1)[0].strip() for raw in f):
                if line.startswith("URIs:"):
                    uris += line.split()[1:]
                elif line.startswith("deb "):
                    uris += [word for word in line.split()[1:] if "://" in word][:1]
    return [u for u in dict.fromkeys(uris) if u.rstrip("/").endswith("/debian")]


def recipe(python: Python) -> str:
    """Everything that goes into the root; its hash names the root's directory."""
    return json.dumps(
        [python.suite, PACKAGES, requirements(), pip_settings()], sort_keys=True
    )


def root_path(python: Python) -> str:
    digest = hashlib.sha256(recipe(python).encode()).hexdigest()[:12]
    base = CACHE if os.path.isdir(CACHE) else tempfile.gettempdir()
    return os.path.join(base, f"shmwatch-python{python.version}-{digest}")


def _hooks(work: str) -> List[str]:
    pip_conf = os.path.join(work, "pip.conf")
    with open(pip_conf, "w") as f:
        f.write(pip_conf_text(pip_settings()))
    hooks = [
        'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
        f"upload {pip_conf} /etc/pip.conf",
    ]
    cas = sorted(glob.glob("/usr/local/share/ca-certificates/*.crt"))
    if (
        cas
    ):  # an egress proxy's CA: pip in the root must trust what pip on the host trusts
        hooks += [
            f"copy-in {' '.join(cas)} /usr/local/share/ca-certificates/",
            'chroot "$1" update-ca-certificates >/dev/null',
        ]
    install = [
        "python3",
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-cache-dir",
        "--root-user-action=ignore",
        "--disable-pip-version-check",
        *requirements(),
    ]
    return [*hooks, f'chroot "$1" {shlex.join(install)}', 'mkdir -p "$1"/src']


def build(python: Python, where: str, timeout: float = 900) -> float:
    """mmdebstrap of the suite with python3 and pip, the requirements installed, into
    `where` (made beside it, then renamed: a root there is whole). Seconds taken."""
    mmdebstrap, mirrors = shutil.which("mmdebstrap"), debian_mirrors()
    if not mmdebstrap or not mirrors:
        raise RuntimeError(
            "needs mmdebstrap (Debian package; .ci/run installs it) and a Debian apt source"
        )
    started, partial = time.monotonic(), f"{where}.partial-{os.getpid()}"
    work = tempfile.mkdtemp(prefix="shmwatch-root-")
    try:
        argv = [
            mmdebstrap,
            "--quiet",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            '--aptopt=Acquire::Check-Valid-Until "false"',  # snapshot mirrors have old Release dates
            *(f"--customize-hook={hook}" for hook in _hooks(work)),
            python.suite,
            partial,
            *(f"deb {m} {python.suite} main" for m in mirrors),
        ]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(
                f"mmdebstrap {python.suite} exited {done.returncode}: {done.stderr[-3000:]}"
            )
        os.rename(partial, where)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(partial, ignore_errors=True)
    return time.monotonic() - started


def ensure(python: Python, rebuild: bool = False) -> str:
    """The root for `python`, built if missing (one build at a time: a lock beside it); older
    roots of the same Python are removed."""
    where = root_path(python)
    with open(
        f"{os.path.dirname(where)}/shmwatch-python{python.version}.lock", "w"
    ) as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if rebuild:
            shutil.rmtree(where, ignore_errors=True)
        if not os.path.isdir(where):
            build(python, where)
        for old in glob.glob(
            f"{os.path.dirname(where)}/shmwatch-python{python.version}-*"
        ):
            if old != where and ".partial-" not in old:
                shutil.rmtree(old, ignore_errors=True)
    return where


def run_fast_tier(
    root: str,
    timeout: float = 600,
    extra: Optional[List[str]] = None,
    paths: Sequence[str] = FAST_TIER,
) -> "subprocess.CompletedProcess[str]":
    """The fast tier's pytest in the root, as CI runs the suite (CI=true: a prerequisite
    missing fails) and with DeprecationWarning an error. Its output, stdout and stderr
    together."""
    inner = [
        "python3",
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-c",
        "/src/pyproject.toml",
        "--rootdir=/src",
        "-r",
        "fEs",
        "-W",
        "error::DeprecationWarning",
        *(extra or []),
        *(f"--deselect={test}" for test in NOT_IN_ROOT),
        *(f"/src/{path}" for path in paths),
    ]
    env = [
        "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME=/tmp",
        "LANG=C.UTF-8",
        "CI=true",
        "PYTHONDONTWRITEBYTECODE=1",
        "PYTHONPATH=/src",
    ]
    r, src = shlex.quote(root), shlex.quote(REPO)
    script = "\n".join(
        [
            "set -e",
            # The root a mount of its own, as a container's is: a test that makes its own
            # mount namespace private (unshare --propagation private) needs / to be a mount.
            f"mount --bind {r} {r}",
            f"mount --bind {src} {r}/src",
            f"mount -o remount,bind,ro {r}/src",
            f"mount -t proc proc {r}/proc",
            f"mount --rbind /dev {r}/dev",
            f"mount -t tmpfs -o size=1g tmpfs {r}/tmp",
            f"cd {r}/tmp",
            f"exec chroot {r} /usr/bin/env -i {shlex.join(env)} sh -c {shlex.quote('cd /tmp && exec ' + shlex.join(inner))}",
        ]
    )
    argv = [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "--pid",
        "--fork",
        "sh",
        "-c",
        script,
    ]
    return subprocess.run(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Build the roots and run the fast tier in each."
    )
    parser.add_argument("--rebuild", action="store_true", help="build the roots anew")
    args = parser.parse_args()
    failed = False
    for python in OTHERS:
        started = time.monotonic()
        root = ensure(python, args.rebuild)
        ready = time.monotonic()
        done = run_fast_tier(root)
        print(done.stdout[-4000:])
        print(
            f"Python {python.version} ({python.suite}): root {root} ready in {ready - started:.0f} s, "
            f"fast tier {time.monotonic() - ready:.0f} s, exit {done.returncode}"
        )
        failed |= done.returncode != 0
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
