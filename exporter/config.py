"""Command-line flags, node_exporter style, each also read from SHMWATCH_<FLAG> (a given flag
wins; a repeatable one's is a comma list); a bad value: one line naming it, exit code 2."""

import argparse
import math
import os
import re
from fractions import Fraction
from functools import partial
from types import SimpleNamespace
from typing import Callable, Dict, Optional, Sequence

from exporter import __version__
from exporter.collectors import REGISTRY

# The collectors with a --[no-]collector.<name> flag; those on in node mode only.
COLLECTORS = tuple(r.name for r in REGISTRY.values() if r.flag)
NODE_DEFAULT_COLLECTORS = tuple(
    r.name for r in REGISTRY.values() if r.flag and "sidecar" not in r.modes
)

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtpe]i?)?b?\s*$", re.IGNORECASE)


def parse_duration(text: str, zero: bool = False) -> float:
    """'500ms', '15s', '1m', '2h' or bare seconds -> seconds > 0; `zero`: 0 too ("never wait")."""
    match = _DURATION.match(str(text))
    if not match:
        raise ValueError(f"invalid duration {text!r} (use e.g. 500ms, 15s, 1m)")
    seconds = float(match.group(1)) * _DURATION_UNITS[match.group(2)]
    if not math.isfinite(seconds):  # 400 digits make inf, and sleep(inf) raises
        raise ValueError(f"invalid duration {text!r}: too large")
    if seconds <= 0 and not (zero and set(match.group(1)) <= set("0.")):
        raise ValueError(f"invalid duration {text!r}: must be above 0")
    return seconds


def parse_size(text: str) -> int:
    """'64Mi', '16Gi', '2g', '512k', '1048576' -> bytes; Kubernetes' K, M, G are decimal,
    docker's lower-case k, m, g (`--shm-size 2g`) binary."""
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"invalid size {text!r} (use e.g. 64Mi, 16Gi, 2g)")
    # Exact: a float would round sizes above 2**53 and make inf of a long digit string.
    number, suffix = Fraction(match.group(1)), match.group(2) or ""
    power = "kmgtpe".index(suffix[0].lower()) + 1 if suffix else 0
    binary = suffix.lower().endswith("i") or suffix[:1].islower()
    return int(number * (1024 if binary else 1000) ** power)


def parse_listen_address(text: str) -> "tuple[str, int]":
    """':9841', '[::]:9841', '127.0.0.1:0', '[::1]:9841' -> (host, port); '' is every address."""
    host, sep, port = str(text).rpartition(":")
    why = "use host:port, e.g. :9841"
    if sep and port.isdigit() and int(port) <= 65535:
        bracketed = host.startswith("[")
        if bracketed == host.endswith("]") and (bracketed or ":" not in host):
            return host[1:-1] if bracketed else host, int(port)
        why = "an IPv6 host goes in brackets: [::1]:9841"
    raise ValueError(f"invalid address {text!r} ({why})")


def typed(kind):  # text -> value, ValueError on bad text: as an argparse type
    def convert(text: str):
        try:
            return kind(text)
        except ValueError as err:
            raise argparse.ArgumentTypeError(str(err)) from None

    return convert


def env_name(flag: str) -> str:
    return "SHMWATCH_" + re.sub(r"[.\-]", "_", flag.lstrip("-")).upper()


def _regex(text: str) -> str:
    try:
        return re.compile(text).pattern
    except re.error as err:
        raise ValueError(f"invalid regex: {err}") from None


def _checked(test: Callable[[str], bool], message: str, value=str) -> Callable:
    def convert(text: str):
        if not test(text):
            raise ValueError(message.format(text))
        return value(text)

    return convert


def _one_of(*choices: str) -> Callable[[str], str]:
    return _checked(choices.__contains__, "{!r} is not one of " + ", ".join(choices))


parse_duration_or_zero = partial(parse_duration, zero=True)
LOG_LEVELS = ("debug", "info", "warning", "error")
# A flag's kind: text -> value, a ValueError that names what is wrong.
KINDS: Dict[str, Callable[[str], object]] = {
    "text": str,
    "address": parse_listen_address,
    "url-path": _checked(lambda t: t.startswith("/"), "must start with '/', got {!r}"),
    "size": parse_size,
    "duration": parse_duration,
    "duration-or-0": parse_duration_or_zero,
    "count": _checked(
        lambda t: t.isdigit() and int(t) > 0,
        "invalid count {!r}: a whole number above 0",
        int,
    ),
    "regex": _regex,
    "mode": _one_of("sidecar", "node"),
    "log-level": _checked(lambda t: t.lower() in LOG_LEVELS, "unknown level {!r}"),
    "log-format": _one_of("logfmt", "json"),
}

# Every flag once: name, Config field (but "listen": listen_host and listen_port), kind
# (KINDS; "..." repeatable), default if any (as text, converted like a given value), then
# after two spaces its help text, continued on indented lines.
_ENTRY = r"^(--\S+) (\w+) ([\w-]+)(\.\.\.)?(?: (\S+))?  (.*(?:\n .*)*)"
_TABLE = """
--web.listen-address listen address :9841  Address to serve /metrics on; ':9841' and
    '[::]:9841' are every address, IPv6 and IPv4.
--web.telemetry-path telemetry_path url-path /metrics  Path of the metrics page.
--web.config.file web_config_file text  exporter-toolkit web config (YAML): TLS, client
    certificates, basic auth, headers; re-read on change.
--web.tls-cert-file tls_cert_file text  Deprecated alias of tls_server_config.cert_file
    in --web.config.file: enables HTTPS.
--web.tls-key-file tls_key_file text  Deprecated alias of tls_server_config.key_file in
    --web.config.file.
--web.tls-client-ca-file tls_client_ca_file text  Deprecated alias of client_ca_file
    with client_auth_type RequireAndVerifyClientCert: mTLS.
--web.max-requests max_requests count 40  Requests answered at once (as
    node_exporter's); beyond them 503 at once.
--mode mode mode sidecar  sidecar: watch --shm.mount; node: also discover every pod's
    and container's shm from the host's mountinfo.
--path.procfs procfs text /proc  procfs mount point.
--path.sysfs sysfs text /sys  sysfs mount point.
--path.rootfs rootfs text /  Root of the filesystem the shm mounts are found under.
--path.kmsg kmsg text /dev/kmsg  The kernel log device the oom collector reads OOM kill
    reports from (not under --path.rootfs: in a container it is a device given to it,
    e.g. docker --device /dev/kmsg).
--shm.mount shm_mounts text... /dev/shm  tmpfs mount to watch (repeatable; default
    /dev/shm).
--shm.size-limit shm_size_limit size  Configured size limit of the shm volume (emptyDir
    sizeLimit), e.g. 16Gi.
--poll-interval poll_interval duration 1s  How often cheap sources are polled.
--inventory-interval inventory_interval duration 15s  How often the full segment
    inventory runs (also on inotify events).
--peak-window peak_window duration 60s  Window of shmwatch_mount_peak_used_bytes.
--segments.top-k top_k count 10  How many segments and processes get their own series.
--segments.ignore-unreadable ignore_unreadable regex  Regex on comm: root-owned
    processes whose /proc entries cannot be read but that hold no shm (a VM agent as pid
    1 that even root cannot inspect) do not make held-by-nobody segments unverified.
--segments.full-scan-interval full_scan_interval duration-or-0 2m  Node mode: how often
    every process on the node is read for the segments it holds, doubled (up to 8 times)
    while nothing changes and none is 'orphan'. In between, the inventory reads new
    processes, the pods of holders that exited and of mounts that moved while a segment
    there is 'orphan'; a new segment is its creator's ('linked'), one its pod's read
    finds unheld since the last full scan 'unverified', until a full scan may call it
    'orphan'. 0: every inventory run reads every process.
--inventory.max-segments max_segments count 150000  Per mount: past this many files the
    inventory keeps only their counts and bytes by class (state 'unverified', no names,
    no owners) and says so in shmwatch_inventory_degraded. Below it a file costs ~200
    bytes: the default fits the sidecar manifest's 96 MiB limit.
--collector.timeout collector_timeout duration 10s  A collector run longer than this is
    marked failed.
--collector.gpu.timeout gpu_timeout duration 5s  Bound on one NVML sweep.
--cgroup.path cgroup_path text  Memory cgroup to watch, as in /proc/<pid>/cgroup (e.g.
    /kubepods/pod1) or a directory under sysfs.
--cgroup.target-process cgroup_target_process regex  Watch the cgroup of the first
    process whose comm or cmdline matches this regex.
--memory.limit-bytes memory_limit_bytes size  Memory limit of the workload (Downward API
    limits.memory); used where tighter than the cgroup's, ignored at or above the host's
    MemTotal.
--log.level log_level log-level info  debug, info, warning or error.
--log.format log_format log-format logfmt  logfmt or json (one JSON object a line).
"""
FLAGS = tuple(
    (flag, dest, KINDS[kind], default or None, " ".join(text.split()), bool(dots))
    for flag, dest, kind, dots, default, text in re.findall(_ENTRY, _TABLE, re.M)
)
Config = SimpleNamespace  # FLAGS' dests (listen: listen_host, listen_port), collectors, inotify


def _switch(env: str, default: Optional[bool]) -> Optional[bool]:
    text = os.environ.get(env)
    off = text is not None and text.strip().lower() in ("0", "false", "no", "off")
    return default if text is None else not off


def build_parser(prog: str = "shmwatch") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Prometheus exporter for shared memory in LLM-serving pods.",
        allow_abbrev=False,
    )
    # A bad flag: one line, no usage dump (the message names the flag).
    parser.error = lambda message: parser.exit(2, f"{prog}: error: {message}\n")
    version = f"shmwatch {__version__}"
    parser.add_argument("--version", action="version", version=version)
    for flag, dest, kind, default, text, repeatable in FLAGS:
        parser.add_argument(  # not given: parse_args reads its env and default
            flag,
            dest=dest,
            type=typed(kind),
            action="append" if repeatable else "store",
            help=f"{text} [env {env_name(flag)}]",
        )
    for name in COLLECTORS:
        flag = f"--collector.{name}"
        on_by_default = None if name in NODE_DEFAULT_COLLECTORS else True
        parser.add_argument(  # and --no-collector.<name>
            flag,
            dest=f"collector_{name}",
            action=argparse.BooleanOptionalAction,
            default=_switch(env_name(flag), on_by_default),
            help=f"Enable or disable the {name} collector (default "
            f"{'on' if on_by_default else 'on in node mode'}) [env {env_name(flag)}].",
        )
    parser.add_argument(
        "--no-inotify",
        dest="inotify",
        action="store_false",
        default=_switch("SHMWATCH_INOTIFY", True),
        help="Poll instead of watching mounts with inotify [env SHMWATCH_INOTIFY=false].",
    )
    return parser


def parse_args(argv: Optional[Sequence[str]] = None, parser=None):
    """-> Config; with a parser of the caller's (which may add arguments): (Config, namespace)."""
    own_parser = parser is None
    parser = parser or build_parser()
    ns = parser.parse_args(argv)
    cfg = Config()
    for flag, dest, kind, default, _text, repeatable in FLAGS:
        value, env = getattr(ns, dest), os.environ.get(env_name(flag))
        text = default if env is None else env
        if value is None and text is not None:  # a repeatable flag's: a comma list
            try:
                value = [kind(v) for v in text.split(",")] if repeatable else kind(text)
            except ValueError as err:
                parser.error(f"argument {flag} (from {env_name(flag)}): {err}")
        setattr(cfg, dest, value)
    cfg.listen_host, cfg.listen_port = vars(cfg).pop("listen")
    cfg.shm_mounts = list(dict.fromkeys(m.rstrip("/") or "/" for m in cfg.shm_mounts))
    on = {name: getattr(ns, f"collector_{name}") for name in COLLECTORS}
    cfg.collectors = {n: cfg.mode == "node" if v is None else v for n, v in on.items()}
    cfg.inotify = ns.inotify
    if cfg.cgroup_path and cfg.cgroup_target_process:
        parser.error(
            "arguments --cgroup.path and --cgroup.target-process: give one, not both"
        )
    return cfg if own_parser else (cfg, ns)
