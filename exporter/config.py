"""Command-line flags, node_exporter style, each also read from SHMWATCH_<FLAG>.

`--poll-interval` is read from SHMWATCH_POLL_INTERVAL, `--web.listen-address` from
SHMWATCH_WEB_LISTEN_ADDRESS: the flag upper-cased with '.' and '-' turned into '_'.
A flag given on the command line wins over the environment. Repeatable flags take a
comma-separated list from the environment. Bad values end in one line on stderr that
names the flag, and exit code 2.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Dict, List, Optional, Sequence

from exporter import __version__
from exporter.collectors import registered

# The collectors with a --[no-]collector.<name> flag, as registered (collectors/__init__.py);
# those whose default depends on --mode: on in node mode, off in a sidecar.
COLLECTORS = tuple(r.name for r in registered() if r.flag)
NODE_DEFAULT_COLLECTORS = tuple(
    r.name for r in registered() if r.flag and "sidecar" not in r.modes
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]i?)?b?\s*$", re.IGNORECASE)


def parse_duration(text: str) -> float:
    """'500ms', '15s', '1m', '2h' or a bare number of seconds -> seconds (float > 0)."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"invalid duration {text!r} (use e.g. 500ms, 15s, 1m)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # 400 digits make inf, and sleep(inf) raises
        raise ValueError(f"invalid duration {text!r}: too large")
    if seconds <= 0:
        raise ValueError(f"invalid duration {text!r}: must be above 0")
    return seconds


def parse_duration_or_zero(text: str) -> float:
    """As parse_duration, and 0 (or 0s): "never wait", e.g. a full scan on every run."""
    if re.fullmatch(r"\s*0+(?:\.0*)?\s*(?:ms|s|m|h)?\s*", str(text)):
        return 0.0
    return parse_duration(text)


def parse_size(text: str) -> int:
    """'64Mi', '16Gi', '2g', '512k', '1048576' -> bytes.

    Both binary (Ki, Mi, Gi) and the Kubernetes-style decimal suffixes (k, M, G) are
    accepted; a bare 'g' means GiB as in `docker run --shm-size 2g`.
    """
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"invalid size {text!r} (use e.g. 64Mi, 16Gi, 2g)")
    # Exact arithmetic: a float would round 2363E (and any size above 2**53) and make inf
    # (then OverflowError) of a long digit string.
    number, suffix = Fraction(match.group(1)), (match.group(2) or "")
    letters = "kmgtpe"
    if not suffix:
        return int(number)
    power = letters.index(suffix[0].lower()) + 1
    if suffix.lower().endswith("i") or suffix[0].islower():
        # Ki/Mi/Gi and docker's lower-case k/m/g are powers of 1024.
        return int(number * 1024**power)
    return int(number * 1000**power)  # Kubernetes' K, M, G are powers of 1000.


def parse_listen_address(text: str) -> "tuple[str, int]":
    """':9841', '[::]:9841', '0.0.0.0:9841', '127.0.0.1:0', '[::1]:9841' -> (host, port).

    An empty host (':9841') means every address, IPv6 and IPv4 (server.listen_family)."""
    host, sep, port = str(text).rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ValueError(f"invalid address {text!r} (use host:port, e.g. :9841)")
    if host.startswith("[") != host.endswith("]") or (
        ":" in host and not host.startswith("[")
    ):
        raise ValueError(
            f"invalid address {text!r} (an IPv6 host goes in brackets: [::1]:9841)"
        )
    return host[1:-1] if host.startswith("[") else host, int(port)


@dataclass
class Config:
    listen_host: str = ""  # every address, IPv6 and IPv4
    listen_port: int = 9841
    telemetry_path: str = "/metrics"
    procfs: str = "/proc"
    sysfs: str = "/sys"
    rootfs: str = "/"
    kmsg: str = "/dev/kmsg"
    shm_mounts: List[str] = field(default_factory=lambda: ["/dev/shm"])
    shm_size_limit: Optional[int] = None
    poll_interval: float = 1.0
    inventory_interval: float = 15.0
    peak_window: float = 60.0
    top_k: int = 10
    collectors: Dict[str, bool] = field(
        default_factory=lambda: {c: True for c in COLLECTORS}
    )
    collector_timeout: float = 10.0
    gpu_timeout: float = 5.0
    cgroup_path: Optional[str] = None
    cgroup_target_process: Optional[str] = None
    ignore_unreadable: Optional[str] = None
    full_scan_interval: float = 120.0
    memory_limit_bytes: Optional[int] = None
    inotify: bool = True
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    tls_client_ca_file: Optional[str] = None
    web_config_file: Optional[str] = None
    log_level: str = "info"
    log_format: str = "logfmt"
    mode: str = "sidecar"


class FlagError(Exception):
    """A bad flag value; the message names the flag."""


class _Parser(argparse.ArgumentParser):
    usage_exit_code = 2

    def error(self, message: str) -> "NoReturn":  # type: ignore[name-defined]  # noqa: F821
        # One line, no usage dump: the message already names the flag.
        self.exit(self.usage_exit_code, f"{self.prog}: error: {message}\n")


def typed(kind, flag: str):
    def convert(text: str):
        try:
            return kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    convert.__name__ = flag  # argparse names the converter in "invalid <name> value"
    return convert


def _positive_int(text: str) -> int:
    if not str(text).isdigit() or int(text) < 1:
        raise ValueError(f"invalid count {text!r}: a whole number above 0")
    return int(text)


def _env_name(flag: str) -> str:
    return "SHMWATCH_" + re.sub(r"[.\-]", "_", flag.lstrip("-")).upper()


# (flag, dest, converter, default, help, repeatable)
FLAGS = (
    (
        "--web.listen-address",
        "listen",
        parse_listen_address,
        ":9841",
        "Address to serve /metrics on; ':9841' and '[::]:9841' are every address, IPv6 and IPv4.",
        False,
    ),
    (
        "--web.telemetry-path",
        "telemetry_path",
        str,
        "/metrics",
        "Path of the metrics page.",
        False,
    ),
    (
        "--web.config.file",
        "web_config_file",
        str,
        None,
        "exporter-toolkit web config (YAML): TLS, client certificates, basic auth, headers; re-read on change.",
        False,
    ),
    (
        "--web.tls-cert-file",
        "tls_cert_file",
        str,
        None,
        "Deprecated alias of tls_server_config.cert_file in --web.config.file: enables HTTPS.",
        False,
    ),
    (
        "--web.tls-key-file",
        "tls_key_file",
        str,
        None,
        "Deprecated alias of tls_server_config.key_file in --web.config.file.",
        False,
    ),
    (
        "--web.tls-client-ca-file",
        "tls_client_ca_file",
        str,
        None,
        "Deprecated alias of client_ca_file with client_auth_type RequireAndVerifyClientCert: mTLS.",
        False,
    ),
    (
        "--mode",
        "mode",
        str,
        "sidecar",
        "sidecar: watch --shm.mount; node: also discover every pod's and container's shm from the host's mountinfo.",
        False,
    ),
    ("--path.procfs", "procfs", str, "/proc", "procfs mount point.", False),
    ("--path.sysfs", "sysfs", str, "/sys", "sysfs mount point.", False),
    (
        "--path.rootfs",
        "rootfs",
        str,
        "/",
        "Root of the filesystem the shm mounts are found under.",
        False,
    ),
    (
        "--path.kmsg",
        "kmsg",
        str,
        "/dev/kmsg",
        "The kernel log device the oom collector reads OOM kill reports from (not under --path.rootfs: in a "
        "container it is a device given to it, e.g. docker --device /dev/kmsg).",
        False,
    ),
    (
        "--shm.mount",
        "shm_mounts",
        str,
        None,
        "tmpfs mount to watch (repeatable; default /dev/shm).",
        True,
    ),
    (
        "--shm.size-limit",
        "shm_size_limit",
        parse_size,
        None,
        "Configured size limit of the shm volume (emptyDir sizeLimit), e.g. 16Gi.",
        False,
    ),
    (
        "--poll-interval",
        "poll_interval",
        parse_duration,
        "1s",
        "How often cheap sources are polled.",
        False,
    ),
    (
        "--inventory-interval",
        "inventory_interval",
        parse_duration,
        "15s",
        "How often the full segment inventory runs (also on inotify events; once per scrape when scrapes are "
        "rarer and inotify watches every mount).",
        False,
    ),
    (
        "--peak-window",
        "peak_window",
        parse_duration,
        "60s",
        "Window of shmwatch_mount_peak_used_bytes.",
        False,
    ),
    (
        "--segments.top-k",
        "top_k",
        _positive_int,
        "10",
        "How many segments and processes get their own series.",
        False,
    ),
    (
        "--segments.ignore-unreadable",
        "ignore_unreadable",
        str,
        None,
        "Regex on comm: root-owned processes whose /proc entries cannot be read but that hold no shm (a VM agent "
        "as pid 1 that even root cannot inspect) do not make held-by-nobody segments unverified.",
        False,
    ),
    (
        "--segments.full-scan-interval",
        "full_scan_interval",
        parse_duration_or_zero,
        "2m",
        "Node mode: how often every process on the node is read for the segments it holds. In between, the "
        "inventory reads only new processes, the pods of holders that exited and the pods whose mount moved; a "
        "segment nobody holds that is new, or was held at the last full scan, is 'unverified' until the next "
        "full scan may call it 'orphan'. 0: every inventory run reads every process.",
        False,
    ),
    (
        "--collector.timeout",
        "collector_timeout",
        parse_duration,
        "10s",
        "A collector run longer than this is marked failed.",
        False,
    ),
    (
        "--collector.gpu.timeout",
        "gpu_timeout",
        parse_duration,
        "5s",
        "Bound on one NVML sweep.",
        False,
    ),
    (
        "--cgroup.path",
        "cgroup_path",
        str,
        None,
        "Memory cgroup to watch, as in /proc/<pid>/cgroup (e.g. /kubepods/pod1) or a directory under sysfs.",
        False,
    ),
    (
        "--cgroup.target-process",
        "cgroup_target_process",
        str,
        None,
        "Watch the cgroup of the first process whose comm or cmdline matches this regex.",
        False,
    ),
    (
        "--memory.limit-bytes",
        "memory_limit_bytes",
        parse_size,
        None,
        "Memory limit of the workload (Downward API limits.memory); used when the cgroup has none.",
        False,
    ),
    ("--log.level", "log_level", str, "info", "debug, info, warning or error.", False),
    (
        "--log.format",
        "log_format",
        str,
        "logfmt",
        "logfmt or json (one JSON object a line).",
        False,
    ),
)


def build_parser(prog: str = "shmwatch") -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog,
        description="Prometheus exporter for shared memory in LLM-serving pods.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--version", action="version", version=f"shmwatch {__version__}"
    )
    for flag, dest, kind, default, text, repeatable in FLAGS:
        env = os.environ.get(_env_name(flag))
        if env is not None:
            default = env.split(",") if repeatable else env
        elif repeatable:
            default = None
        help_text = f"{text} [env {_env_name(flag)}]"
        if repeatable:
            parser.add_argument(
                flag,
                dest=dest,
                type=typed(kind, flag),
                action="append",
                default=None,
                help=help_text,
            )
            parser.set_defaults(**{dest + "_env": default})
        else:
            parser.add_argument(
                flag,
                dest=dest,
                type=typed(kind, flag),
                default=default,
                help=help_text,
            )
    for name in COLLECTORS:
        flag = f"--collector.{name}"
        env = os.environ.get(_env_name(flag))
        on_by_default: Optional[bool] = (
            None if name in NODE_DEFAULT_COLLECTORS else True
        )
        default = (
            on_by_default
            if env is None
            else env.strip().lower() not in ("0", "false", "no", "off")
        )
        parser.add_argument(
            flag,
            dest=f"collector_{name}",
            action="store_true",
            default=default,
            help=f"Enable the {name} collector (default "
            f"{'on' if on_by_default else 'on in node mode'}) [env {_env_name(flag)}].",
        )
        parser.add_argument(
            f"--no-collector.{name}",
            dest=f"collector_{name}",
            action="store_false",
            help=f"Disable the {name} collector.",
        )
    inotify_env = os.environ.get("SHMWATCH_INOTIFY")
    parser.add_argument(
        "--no-inotify",
        dest="inotify",
        action="store_false",
        default=inotify_env is None
        or inotify_env.lower() not in ("0", "false", "no", "off"),
        help="Poll instead of watching mounts with inotify [env SHMWATCH_INOTIFY=false].",
    )
    return parser


def parse_args(
    argv: Optional[Sequence[str]] = None, prog: str = "shmwatch", parser=None
):
    """-> Config; with a parser of the caller's (which may add arguments): (Config, namespace)."""
    own_parser = parser is None
    parser = parser or build_parser(prog)
    ns = parser.parse_args(argv)
    # Env defaults bypass argparse's type conversion for repeatables and are strings
    # for the others: convert them here so a bad env value fails like a bad flag.
    values = {}
    for flag, dest, kind, _default, _text, repeatable in FLAGS:
        value = getattr(ns, dest)
        if repeatable and value is None:
            value = getattr(ns, dest + "_env")
        try:
            if isinstance(value, str) and not repeatable:
                value = kind(value)
            elif repeatable and value is not None:
                value = [kind(v) if isinstance(v, str) else v for v in value]
        except ValueError as err:
            parser.error(f"argument {flag} (from {_env_name(flag)}): {err}")
        values[dest] = value
    cfg = Config()
    cfg.listen_host, cfg.listen_port = values["listen"]
    for key in (
        "telemetry_path",
        "tls_cert_file",
        "tls_key_file",
        "tls_client_ca_file",
        "web_config_file",
        "log_format",
        "procfs",
        "sysfs",
        "kmsg",
        "rootfs",
        "shm_size_limit",
        "poll_interval",
        "inventory_interval",
        "peak_window",
        "top_k",
        "collector_timeout",
        "gpu_timeout",
        "cgroup_path",
        "cgroup_target_process",
        "memory_limit_bytes",
        "log_level",
        "mode",
        "ignore_unreadable",
        "full_scan_interval",
    ):
        setattr(cfg, key, values[key])
    if values["shm_mounts"]:
        cfg.shm_mounts = list(
            dict.fromkeys(m.rstrip("/") or "/" for m in values["shm_mounts"])
        )
    cfg.collectors = {name: getattr(ns, f"collector_{name}") for name in COLLECTORS}
    for name in NODE_DEFAULT_COLLECTORS:
        if cfg.collectors[name] is None:
            cfg.collectors[name] = cfg.mode == "node"
    cfg.inotify = ns.inotify
    if not cfg.telemetry_path.startswith("/"):
        parser.error(
            f"argument --web.telemetry-path: must start with '/', got {cfg.telemetry_path!r}"
        )
    if cfg.mode not in ("sidecar", "node"):
        parser.error(f"argument --mode: {cfg.mode!r} is not one of sidecar, node")
    if cfg.log_level.lower() not in ("debug", "info", "warning", "error"):
        parser.error(f"argument --log.level: unknown level {cfg.log_level!r}")
    if cfg.log_format not in ("logfmt", "json"):
        parser.error(
            f"argument --log.format: {cfg.log_format!r} is not one of logfmt, json"
        )
    if cfg.web_config_file and (
        cfg.tls_cert_file or cfg.tls_key_file or cfg.tls_client_ca_file
    ):
        parser.error(
            "argument --web.config.file: give it or the deprecated --web.tls-* flags, not both "
            "(move them to tls_server_config)"
        )
    if cfg.tls_key_file and not cfg.tls_cert_file:
        parser.error("argument --web.tls-key-file: needs --web.tls-cert-file too")
    if cfg.tls_cert_file and not cfg.tls_key_file:
        parser.error("argument --web.tls-cert-file: needs --web.tls-key-file too")
    if cfg.tls_client_ca_file and not cfg.tls_cert_file:
        parser.error(
            "argument --web.tls-client-ca-file: mTLS needs --web.tls-cert-file and --web.tls-key-file"
        )
    if cfg.cgroup_path and cfg.cgroup_target_process:
        parser.error(
            "arguments --cgroup.path and --cgroup.target-process: give one, not both"
        )
    for flag, pattern in (
        ("--cgroup.target-process", cfg.cgroup_target_process),
        ("--segments.ignore-unreadable", cfg.ignore_unreadable),
    ):
        if pattern:
            try:
                re.compile(pattern)
            except re.error as err:
                parser.error(f"argument {flag}: invalid regex: {err}")
    return cfg if own_parser else (cfg, ns)


def fail(flag: str, message: str) -> "NoReturn":  # type: ignore[name-defined]  # noqa: F821
    """End start-up with one line naming the flag (for errors found after parsing)."""
    sys.stderr.write(f"shmwatch: error: argument {flag}: {message}\n")
    sys.exit(2)
