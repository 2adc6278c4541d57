"""Dependency floors that hold: shmwatch installs, starts and serves a scrape with the
lowest version of every runtime dependency that pyproject.toml allows
(.ci/lowest-constraints.txt), in a fresh venv with packages from the package index."""

import base64
import gzip
import os
import re
import shutil
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request

import pytest

from tests.conftest import EVERY_FAMILY, REPO, Exporter, prerequisite_missing, value
from tests.system.test_gpu import TWO_GPUS, GiB, config, gpu_env, stub_dir  # noqa: F401 (stub_dir: a fixture)

CONSTRAINTS = os.path.join(REPO, ".ci", "lowest-constraints.txt")


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def pyproject_floors() -> dict:
    """name -> the version after `>=` of each runtime dependency."""
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        dependencies = tomllib.load(f)["project"]["dependencies"]
    floors = {}
    for requirement in dependencies:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9.]*)(\s*,.*)?", requirement)
        assert match, f"{requirement!r}: every runtime dependency needs a floor (name>=version)"
        floors[_canonical(match.group(1))] = match.group(2)
    return floors


def pinned() -> dict:
    pins = {}
    with open(CONSTRAINTS) as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                name, version = line.split("==")
                pins[_canonical(name)] = version.strip()
    return pins


def _same_version(floor: str, pin: str) -> bool:
    """`>=0.17` allows 0.17.0 first: trailing zeros do not make another version."""
    def parts(v):
        return [int(p) for p in v.split(".")]
    a, b = parts(floor), parts(pin)
    width = max(len(a), len(b))
    return a + [0] * (width - len(a)) == b + [0] * (width - len(b))


def test_constraints_pin_every_floor_of_pyproject():
    floors, pins = pyproject_floors(), pinned()
    assert sorted(pins) == sorted(floors), "a runtime dependency without its pin, or a pin too many"
    for name, floor in floors.items():
        assert _same_version(floor, pins[name]), f"{name}: pyproject allows >={floor}, constraints pin {pins[name]}"


def _index_url() -> str:
    """The index pip is configured for (environment, then its configuration files), else PyPI."""
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    configured = re.findall(r"^[^=\s]*\.index-url='([^']+)'", listed, re.M)
    return os.environ.get("PIP_INDEX_URL") or (configured[0] if configured else "https://pypi.org/simple/")


def _index_reachable() -> bool:
    index = _index_url().rstrip("/")
    try:
        with urllib.request.urlopen(f"{index}/prometheus-client/", timeout=20) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def lowest_python(tmp_path_factory) -> str:
    """A venv's python with shmwatch installed under the constraints (from a copy of the
    package: building in the checkout would leave build/ and *.egg-info behind)."""
    if not _index_reachable():
        prerequisite_missing("the package index cannot be reached: the lowest versions cannot be installed")
    root = tmp_path_factory.mktemp("floors")
    source = root / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(REPO, name), source / name)
    shutil.copytree(os.path.join(REPO, "exporter"), source / "exporter",
                    ignore=shutil.ignore_patterns("__pycache__"))
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    install = subprocess.run([python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
                              "--constraint", CONSTRAINTS, str(source)], capture_output=True, text=True)
    assert install.returncode == 0, install.stdout + install.stderr
    return python


def test_the_lowest_versions_are_the_ones_installed(lowest_python):
    script = ("import importlib.metadata as m, sys\n"
              "for name in sys.argv[1:]: print(name, m.version(name))")
    out = subprocess.run([lowest_python, "-c", script, *pinned()], capture_output=True, text=True, check=True)
    installed = dict(line.split() for line in out.stdout.splitlines())
    assert installed == pinned()


def test_shmwatch_serves_a_scrape_on_the_lowest_versions(lowest_python, tmp_path):
    # A plain directory as the mount: no tmpfs, no root needed. Every dependency is used:
    # watchdog's inotify on the directory, nvidia-ml-py (the GPU collector reports, failed
    # where there is no driver), PyYAML and bcrypt through a web config with a basic-auth user.
    mount = tmp_path / "shm"
    mount.mkdir()
    hashed = subprocess.run([lowest_python, "-c", "import bcrypt; print(bcrypt.hashpw(b'floor', bcrypt.gensalt(4)).decode())"],
                            capture_output=True, text=True, check=True).stdout.strip()
    web_config = tmp_path / "web.yml"
    web_config.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n")
    auth = {"Authorization": "Basic " + base64.b64encode(b"prometheus:floor").decode()}
    with Exporter(f"--shm.mount={mount}", f"--web.config.file={web_config}", EVERY_FAMILY, run_as=[lowest_python],
                  headers=auth) as exporter:
        text = exporter.scrape_text()
        request = urllib.request.Request(exporter.url, headers={
            **auth, "Accept": "application/openmetrics-text;version=1.0.0,text/plain;version=0.0.4;q=0.5",
            "Accept-Encoding": "gzip"})
        with urllib.request.urlopen(request, timeout=5) as response:
            openmetrics = response.read()
            content_type = response.headers["Content-Type"]
            encoding = response.headers.get("Content-Encoding")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(exporter.url, timeout=5)
    assert refused.value.code == 401
    assert re.search(r'^shmwatch_build_info\{version="[^"]+"\} 1', text, re.M), text[-2000:]
    assert re.search(r'^shmwatch_inotify_active\{mount="[^"]+"\} 1', text, re.M), "inotify (watchdog) not active"
    assert re.search(r'^shmwatch_collector_success\{collector="gpu"\} [01]', text, re.M)  # pynvml loaded
    assert content_type.startswith("application/openmetrics-text")
    if encoding == "gzip":
        openmetrics = gzip.decompress(openmetrics)
    assert b"shmwatch_build_info" in openmetrics and openmetrics.rstrip().endswith(b"# EOF")


def test_gpu_memory_and_processes_on_the_lowest_nvidia_ml_py(lowest_python, stub_dir, tmp_path):  # noqa: F811
    # nvidia-ml-py 12.535.77 read NVML's process list with a struct 8 bytes too long: every
    # process after the first was garbage. The fake NVML (tests/gpu) has two on GPU 0.
    mount = tmp_path / "shm"
    mount.mkdir()
    conf = config(tmp_path, TWO_GPUS)
    with Exporter(f"--shm.mount={mount}", EVERY_FAMILY, env=gpu_env(stub_dir, conf), run_as=[lowest_python]) as exporter:
        samples = exporter.scrape()
    gpu0 = {"gpu": "0", "uuid": "GPU-11111111-2222-3333-4444-555555555555"}
    assert value(samples, "shmwatch_collector_success", collector="gpu") == 1
    assert value(samples, "shmwatch_gpu_memory_reserved_bytes", **gpu0) == 512 << 20
    # By name (issue 44's label contract): ours, and the pids no name resolves for, summed.
    me = open(f"/proc/{os.getpid()}/comm").read().strip()
    assert value(samples, "shmwatch_gpu_process_memory_bytes", comm=me, **gpu0) == 70 * GiB
    assert value(samples, "shmwatch_gpu_process_memory_bytes", comm="unknown", **gpu0) == 3 << 20
