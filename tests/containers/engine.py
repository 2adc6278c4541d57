"""A real container engine for the container tier: Debian's dockerd, a locally built base
image (no registry can be reached), the project's own image from its Dockerfile.

Run as a script to build the images by hand (and see the figures):
    python3 -m tests.containers.engine
"""
from __future__ import annotations

import configparser
import glob
import hashlib
import json
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from typing import Dict, List, Optional

from tests.conftest import stop_process

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BASE_IMAGE = "python:3.11-slim"  # what the Dockerfile's FROM names
# Several checkouts may run the tier on one engine at once: each builds its own image tag,
# and labels its containers with its own run, so cleanup removes this run's only.
_CHECKOUT = hashlib.sha1(REPO.encode()).hexdigest()[:8]
PROJECT_IMAGE = f"shmwatch:test-{_CHECKOUT}"
SERVER_IMAGE = f"shmwatch-test-server:{_CHECKOUT}"
SUITE = "bookworm"
IMAGE_LABEL = "org.shmwatch.test=container-tier"
LABEL = f"org.shmwatch.test.run={uuid.uuid4().hex[:12]}"
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


class EngineUnavailable(Exception):
    """No container engine can be had here (reason in the message)."""


def docker_bin() -> str:
    found = shutil.which("docker")
    if not found:
        raise EngineUnavailable("no `docker` client (Debian package docker.io; .ci/run installs it)")
    return found


def docker(*args: str, check: bool = True, timeout: float = 120, input: Optional[bytes] = None,
           env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    done = subprocess.run([docker_bin(), *args], capture_output=True, timeout=timeout, input=input,
                          env={**os.environ, **(env or {})})
    if check and done.returncode != 0:
        raise RuntimeError(f"docker {shlex.join(args)} exited {done.returncode}:\n"
                           f"{done.stdout.decode(errors='replace')[-3000:]}{done.stderr.decode(errors='replace')[-3000:]}")
    return done


def engine_answers() -> bool:
    try:
        return docker("info", "--format", "{{.ServerVersion}}", check=False, timeout=20).returncode == 0
    except (EngineUnavailable, subprocess.TimeoutExpired):
        return False


class Engine:
    """dockerd, started in the background when none answers; stopped again only if we started it."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.log_path = ""

    def start(self, timeout: float = 60.0) -> None:
        docker_bin()
        if engine_answers():
            return
        if os.geteuid() != 0:
            raise EngineUnavailable("dockerd is not running and only root can start it")
        dockerd = shutil.which("dockerd")
        if not dockerd:
            raise EngineUnavailable("no `dockerd` (Debian package docker.io; .ci/run installs it)")
        self.log_path = tempfile.mktemp(prefix="shmwatch-dockerd-", suffix=".log")
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([dockerd], stdout=log, stderr=log, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise EngineUnavailable(f"dockerd exited {self.proc.returncode}: {self.log_tail()}")
            if engine_answers():
                return
            time.sleep(0.5)
        raise EngineUnavailable(f"dockerd did not answer within {timeout:.0f}s: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return f.read().decode(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc, 30)


def image_exists(name: str) -> bool:
    return docker("image", "inspect", name, check=False, timeout=30).returncode == 0


# ---- the base image -------------------------------------------------------------------------

def debian_sources() -> List[str]:
    """The host's apt sources files that name a Debian archive: the mirror mmdebstrap uses is
    the one this machine (and CI, which is the same kind of machine) is configured to reach."""
    files = [p for p in ["/etc/apt/sources.list", *sorted(glob.glob("/etc/apt/sources.list.d/*.list")),
                         *sorted(glob.glob("/etc/apt/sources.list.d/*.sources"))] if os.path.isfile(p)]
    found = []
    for path in files:
        with open(path, errors="replace") as f:
            text = "\n".join(line for line in f if not line.lstrip().startswith("#"))
        if "/debian" in text and SUITE in text:
            found.append(path)
    return found


# pip settings that name something on this machine's disk cannot be carried into an image.
_LOCAL_VALUED = ("find-links", "extra-index-url", "index-url", "constraint", "requirement")


def pip_settings() -> Dict[str, str]:
    """How pip reaches the package index here (config files and PIP_* variables, as
    `pip config list` reports them), minus what points at local files; the CA bundle is
    the image's own after update-ca-certificates has added the host's extra CAs."""
    done = subprocess.run(["python3", "-m", "pip", "config", "list"], capture_output=True, text=True)
    settings: Dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, raw = line.partition("=")
        if not raw:
            continue
        name = key.rsplit(".", 1)[-1]
        value = raw.strip().strip("'\"")
        if name == "cert":
            settings["cert"] = "/etc/ssl/certs/ca-certificates.crt"
        elif name in _LOCAL_VALUED:
            kept = [v for v in value.split() if v.startswith(("http://", "https://"))]
            if kept:
                settings[name] = " ".join(kept)
        else:
            settings[name] = value
    return settings


def pip_conf_text(settings: Dict[str, str]) -> str:
    config = configparser.ConfigParser()
    config["global"] = settings
    with tempfile.TemporaryFile("w+") as f:
        config.write(f)
        f.seek(0)
        return f.read()


def build_base_image(timeout: float = 900) -> float:
    """mmdebstrap a bookworm minbase with python3 and pip into `python:3.11-slim`. Seconds taken."""
    mmdebstrap = shutil.which("mmdebstrap")
    if not mmdebstrap:
        raise EngineUnavailable("no `mmdebstrap` to build the base image (Debian package mmdebstrap; .ci/run installs it)")
    sources = debian_sources()
    if not sources:
        raise RuntimeError("no Debian apt source configured on this machine for mmdebstrap to use")
    work = tempfile.mkdtemp(prefix="shmwatch-base-")
    try:
        pip_conf = os.path.join(work, "pip.conf")
        with open(pip_conf, "w") as f:
            f.write(pip_conf_text(pip_settings()))
        hooks = [
            # Debian marks its python "externally managed"; the image's pip installs into it.
            'rm -f "$1"/usr/lib/python3*/EXTERNALLY-MANAGED',
            f"upload {pip_conf} /etc/pip.conf",
        ]
        cas = sorted(glob.glob("/usr/local/share/ca-certificates/*.crt"))
        if cas:  # an egress proxy's CA: pip in a build must trust what pip on the host trusts
            hooks += [f"copy-in {' '.join(cas)} /usr/local/share/ca-certificates/",
                      'chroot "$1" update-ca-certificates >/dev/null']
        argv = [mmdebstrap, "--quiet", "--variant=minbase", "--include=python3,python3-pip,python3-venv,ca-certificates",
                '--aptopt=Acquire::Check-Valid-Until "false"',  # snapshot mirrors have old Release dates
                *(f"--customize-hook={hook}" for hook in hooks), SUITE, "-", *sources]
        changes = ["ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "ENV LANG=C.UTF-8",
                   'CMD ["python3"]', f"LABEL {IMAGE_LABEL}"]
        started = time.monotonic()
        strap = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        imported = subprocess.run([docker_bin(), "import", *(a for c in changes for a in ("--change", c)), "-",
                                   BASE_IMAGE], stdin=strap.stdout, capture_output=True, timeout=timeout)
        strap.stdout.close()
        strap_err = strap.stderr.read().decode(errors="replace")
        strap.wait(60)
        if strap.returncode != 0 or imported.returncode != 0:
            raise RuntimeError(f"base image: mmdebstrap exited {strap.returncode}: {strap_err[-3000:]}\n"
                               f"docker import exited {imported.returncode}: {imported.stderr.decode()[-2000:]}")
        return time.monotonic() - started
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_args() -> List[str]:
    """Proxy variables reach RUN steps only as build arguments (Docker predefines these)."""
    out = []
    for name in ("HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy"):
        if os.environ.get(name):
            out += ["--build-arg", f"{name}={os.environ[name]}"]
    return out


def build_project_image(tag: str = PROJECT_IMAGE, timeout: float = 900) -> float:
    """`docker build` of the repository's Dockerfile, as a user would run it. Seconds taken."""
    started = time.monotonic()
    docker("build", "--label", IMAGE_LABEL, *build_args(), "-t", tag, REPO, timeout=timeout)
    return time.monotonic() - started


def build_context_image(tag: str, context: str, timeout: float = 600) -> None:
    docker("build", "--label", IMAGE_LABEL, *build_args(), "-t", tag, context, timeout=timeout)


def image_size(name: str) -> int:
    return int(json.loads(docker("image", "inspect", name).stdout)[0]["Size"])


def main() -> None:
    engine = Engine()
    engine.start()
    try:
        if image_exists(BASE_IMAGE):
            print(f"{BASE_IMAGE}: already there")
        else:
            print(f"{BASE_IMAGE}: built in {build_base_image():.1f}s, {image_size(BASE_IMAGE) / 2**20:.1f} MiB")
        print(f"{PROJECT_IMAGE}: built in {build_project_image():.1f}s, {image_size(PROJECT_IMAGE) / 2**20:.1f} MiB")
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
