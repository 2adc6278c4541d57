"""exporter/__init__.py: one version, pyproject.toml's, whether shmwatch runs from a checkout
or from an install, and a plain "unknown" when it can tell neither."""

import os
import shutil
import subprocess
import sys
import tomllib

import pytest

import exporter
from tests.conftest import REPO


def pyproject_version() -> str:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        return tomllib.load(f)["project"]["version"]


def test_this_checkout_runs_as_its_pyproject_version():
    assert exporter.__version__ == exporter.checkout_version() == pyproject_version()


def test_only_shmwatchs_own_pyproject_gives_the_version(tmp_path):
    pyproject = tmp_path / "pyproject.toml"
    assert exporter.checkout_version(str(tmp_path)) is None  # no file
    pyproject.write_text('[project]\nname = "other"\nversion = "9.9.9"\n')
    assert exporter.checkout_version(str(tmp_path)) is None  # another project's
    pyproject.write_text('[project\nname = "shmwatch"\n')
    assert exporter.checkout_version(str(tmp_path)) is None  # not TOML
    pyproject.write_text('[project]\nname = "shmwatch"\ndynamic = ["version"]\n')
    assert exporter.checkout_version(str(tmp_path)) is None  # no version written
    pyproject.write_text('[project]\nname = "shmwatch"\nversion = "1.2.3"\n')
    assert exporter.checkout_version(str(tmp_path)) == "1.2.3"


def version_in(tmp_path, checkout: bool, installed: bool) -> str:
    """exporter.__version__ of a copy of the package: beside a pyproject.toml of 1.2.3 (a
    checkout) or not, with an installed distribution's metadata of 7.7.7 (as pip writes it:
    a dist-info directory on sys.path) or not; no site-packages (-S), so no other shmwatch."""
    package = tmp_path / "checkout"
    shutil.copytree(os.path.join(REPO, "exporter"), package / "exporter")
    if checkout:
        (package / "pyproject.toml").write_text('[project]\nname = "shmwatch"\nversion = "1.2.3"\n')
    site = tmp_path / "site"
    if installed:
        (site / "shmwatch-7.7.7.dist-info").mkdir(parents=True)
        (site / "shmwatch-7.7.7.dist-info" / "METADATA").write_text(
            "Metadata-Version: 2.1\nName: shmwatch\nVersion: 7.7.7\n")
    code = "import exporter; print(exporter.__version__)"
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": f"{package}:{site}", "PATH": os.environ["PATH"]}, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.parametrize("checkout,installed,version", [
    (True, True, "1.2.3"),  # the checkout's own file, not another checkout's (or a stale) install
    (False, True, "7.7.7"),  # installed (pip install ., the Dockerfile): its metadata
    (True, False, "1.2.3"),  # a PYTHONPATH run of a checkout never installed
    (False, False, exporter.UNKNOWN_VERSION),  # the package alone: no confident number
])
def test_the_version_comes_from_the_checkout_then_the_install(tmp_path, checkout, installed, version):
    assert version_in(tmp_path, checkout, installed) == version


def test_the_version_is_looked_up_on_first_use_only():
    # Importing the package reads no file: only `check`, serving and --version ask for it.
    code = ("import sys, exporter; print('__version__' in vars(exporter), 'tomllib' in sys.modules); "
            "exporter.__version__; print('__version__' in vars(exporter))")
    result = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True, timeout=30,
                            env={"PYTHONPATH": REPO, "PATH": os.environ["PATH"]})
    assert result.stdout.split() == ["False", "False", "True"], result.stderr
