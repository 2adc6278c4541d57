"""shmwatch: a Prometheus exporter for the memory that kills LLM-serving pods.

`exporter.__version__` (`--version`, `shmwatch_build_info{version}`, `check`'s header) is the
version pyproject.toml holds, the only place it is written. It is looked up on first use:

- run from a checkout (a pyproject.toml of shmwatch beside this package: the tests, a
  PYTHONPATH run, an editable install), that file's; an editable install's metadata keeps
  the version of the day it was installed, and another checkout's install answers for
  every checkout on the machine;
- installed (`pip install .`, as the Dockerfile does), the version pip wrote into the
  package metadata (importlib.metadata);
- neither (Python 3.10 reads no TOML; a copy of the package alone): UNKNOWN_VERSION.
"""

import os
from typing import Optional

DISTRIBUTION = "shmwatch"
# PEP 440: below every release, and plainly no release of ours.
UNKNOWN_VERSION = "0+unknown"
CHECKOUT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def checkout_version(root: str = CHECKOUT) -> Optional[str]:
    """The version in `root`/pyproject.toml if that file is shmwatch's, else None."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None
    try:
        with open(os.path.join(root, "pyproject.toml"), "rb") as f:
            project = tomllib.load(f).get("project", {})
    except (OSError, tomllib.TOMLDecodeError):
        return None
    version = project.get("version") if project.get("name") == DISTRIBUTION else None
    return version if isinstance(version, str) else None


def installed_version() -> Optional[str]:
    """The version of the installed distribution, from its metadata, else None."""
    from importlib import metadata

    try:
        return metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        return None


def __getattr__(name: str) -> str:
    """`__version__`, looked up once, on first use: importing the package reads no file."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    version = checkout_version() or installed_version() or UNKNOWN_VERSION
    globals()["__version__"] = version
    return version
