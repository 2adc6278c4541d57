"""`shmwatch` (serve /metrics) and `shmwatch check`, and the process they run in. Log lines
(uncaught exceptions too) as the Prometheus ecosystem writes them: json, or logfmt as go-kit
and slog (`ts=… level=info logger=shmwatch msg="…"`), quoted and escaped so every line parses."""

import gc
import json
import logging
import re
import resource
import signal
import sys
import threading
import time
from contextlib import suppress
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, List, Optional, Type

from exporter import __version__
from exporter.config import Config, bad_flag, parse_args

# What serving needs is imported where it is served: `check`, `--help` and `--version` need
# none of it.
if TYPE_CHECKING:
    from exporter.app import App
    from exporter.exposition.http import Front
    from exporter.exposition.webconfig import WebConfigSource
    from exporter.model.step import Model

log = logging.getLogger("shmwatch")
# gc's gen-0 threshold in serve (not 700): an owner scan makes tens of thousands of objects at
# once, all freed by reference counting: 700 collects many times a second for nothing.
GC_GEN0_THRESHOLD = 50_000
_LEVELS = {"WARNING": "warn", "CRITICAL": "error"}
_SHORT = {"\\": "\\\\", '"': '\\"', "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPES = str.maketrans({chr(c): f"\\u{c:04x}" for c in [*range(32), 127]} | _SHORT)
_QUOTED = re.compile(r'[ ="\\\x00-\x1f\x7f]')  # a value holding one of these is quoted


def logfmt_value(value: object) -> str:
    text = str(value)
    if text and not _QUOTED.search(text):
        return text
    return '"' + text.translate(_ESCAPES) + '"'


class LineFormatter(logging.Formatter):
    json_lines = False  # else logfmt

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        fields = {
            "ts": f"{ts}.{int(record.created % 1 * 1000):03d}Z",
            "level": _LEVELS.get(record.levelname, record.levelname.lower()),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            fields["err"] = self.formatException(record.exc_info)
        if self.json_lines:
            return json.dumps(fields)
        return " ".join(f"{key}={logfmt_value(value)}" for key, value in fields.items())


def check_tls_flags(cfg: Config) -> None:
    """The deprecated --web.tls-* flags come whole (a certificate with its key) and not beside
    --web.config.file; else the process ends as on a bad flag."""
    cert, key, ca = cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file
    if cfg.web_config_file and (cert or key or ca):
        bad_flag(
            "--web.config.file",
            "give it or the deprecated --web.tls-* flags, not both "
            "(move them to tls_server_config)",
        )
    if (key or ca) and not cert:
        flag = "key-file" if key else "client-ca-file"
        bad_flag(f"--web.tls-{flag}", "needs --web.tls-cert-file too")
    if cert and not key:
        bad_flag("--web.tls-cert-file", "needs --web.tls-key-file too")


def web_config(cfg: Config) -> "Optional[WebConfigSource]":
    """--web.config.file's source, or the deprecated flags', or None (plain HTTP, no auth);
    a bad config ends the process with one line naming the flag."""
    from exporter.exposition.webconfig import WebConfigSource
    from exporter.exposition.webschema import WebConfigError

    check_tls_flags(cfg)
    if cfg.web_config_file:
        try:
            return WebConfigSource(path=cfg.web_config_file)
        except WebConfigError as err:  # its line starts with the file's name
            bad_flag("--web.config.file", str(err))
    if cfg.tls_cert_file and cfg.tls_key_file:
        return deprecated_tls(
            cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file
        )
    return None


def _tls_flag_of(error: ValueError) -> str:
    """The --web.tls-* flag whose file a TLS error is about (its message names the field)."""
    fields = {".key_file": "key-file", "client_ca_file": "client-ca-file"}
    named = (flag for field, flag in fields.items() if field in str(error))
    return f"--web.tls-{next(named, 'cert-file')}"


def deprecated_tls(cert: str, key: str, ca: Optional[str]) -> "WebConfigSource":
    """The old flags: aliases of a web config with only tls_server_config (reloaded too)."""
    from exporter.exposition.webconfig import WebConfigSource
    from exporter.exposition.webschema import TlsSettings, WebConfig, WebConfigError

    client_auth = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    tls = TlsSettings(
        cert_file=cert, key_file=key, client_ca_file=ca, client_auth_type=client_auth
    )
    try:
        source = WebConfigSource(fixed=WebConfig(tls=tls))
    except WebConfigError as err:
        bad_flag(_tls_flag_of(err), f"cannot load TLS certificate/key: {err}")
    log.warning(
        "--web.tls-* flags are deprecated: use --web.config.file (tls_server_config)"
    )
    return source


def unraisable_hook(unraisable: "sys.UnraisableHookArgs") -> None:
    """An exception Python cannot raise (in a __del__, a callback at exit) as a log line,
    not the interpreter's "Exception ignored in" lines."""
    exc = unraisable.exc_value
    exc_info = (unraisable.exc_type, exc, unraisable.exc_traceback) if exc else None
    where = unraisable.err_msg or "Exception ignored in"
    log.error("%s: %r", where, unraisable.object, exc_info=exc_info)


def tune_process() -> None:  # serve's own process, not a library user's
    gc.set_threshold(GC_GEN0_THRESHOLD, *gc.get_threshold()[1:])
    # The soft limit on open files up to the hard one, as a Go program (node_exporter)
    # starts: on a large node the kept cgroup files and the connections outgrow 1,024.
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    with suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def collect_once(cfg: Config, timeout: float) -> "Model":
    """`shmwatch check`'s model: one run of every source, the kernel log from its start."""
    from exporter.app import App

    app = App(cfg, kmsg_from_start=True)
    app.start(watch=False)
    app.sampler.wait_for_first_run(timeout)
    model = app.step.current()
    app.stop(wait=0)  # a source still running at check's deadline is left to it
    return model


def log_uncaught(
    exc_type: Type[BaseException],
    exc: BaseException,
    traceback: Optional[TracebackType],
) -> None:
    """sys.excepthook: an exception that ends the main thread, as a log line."""
    log.error("uncaught exception", exc_info=(exc_type, exc, traceback))


def log_uncaught_in_thread(args: "threading.ExceptHookArgs") -> None:
    """threading.excepthook: an exception that ends another thread, as a log line."""
    if args.exc_type is not SystemExit:
        name = args.thread.name if args.thread else "?"
        exc = args.exc_value
        exc_info = (args.exc_type, exc, args.exc_traceback) if exc else None
        log.error("uncaught exception in thread %s", name, exc_info=exc_info)


def log_to_stderr(log_format: str, log_level: str) -> None:
    """Every line on stderr a log line: records, warnings, uncaught and unraisable exceptions."""
    handler = logging.StreamHandler(sys.stderr)
    formatter = LineFormatter()
    formatter.json_lines = log_format == "json"
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]  # the old removed, not closed (as basicConfig's force)
    root.setLevel(getattr(logging, log_level.upper(), logging.INFO))
    logging.captureWarnings(True)  # warnings.warn() as log lines too
    threading.excepthook = log_uncaught_in_thread
    sys.excepthook = log_uncaught
    sys.unraisablehook = unraisable_hook


def main(argv: Optional[List[str]] = None) -> int:
    """`shmwatch [flags]` serves; `shmwatch check [flags]` reports once (check/report.py)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["check"]:
        from exporter.check.report import main as check_main

        return check_main(argv[1:], collect_once)
    cfg = parse_args(argv)
    log_to_stderr(cfg.log_format, cfg.log_level)
    tune_process()
    return serve(cfg)


def serve(cfg: Config) -> int:
    """Serves /metrics until SIGTERM or SIGINT (exit 0, within 2 s) or the HTTP server dies
    (1). A bad web config or an address it cannot listen on ends it first, as a bad flag."""
    from exporter.app import App
    from exporter.exposition.http import url_host

    web = web_config(cfg)
    app = App(cfg, web=web)
    httpd = listen(cfg, app, web)
    done = threading.Event()
    handle_signals(done, web)
    app.start()
    httpd.start()
    scheme = "https" if web and web.tls else "http"
    host, port = httpd.server_address[0], httpd.server_address[1]
    where = f"{scheme}://{url_host(host)}:{port}{cfg.telemetry_path}"
    mounts = ", ".join(cfg.shm_mounts)
    log.info("shmwatch %s listening on %s, watching %s", __version__, where, mounts)
    if not wait_for_stop(done, httpd):
        app.stop()
        return 1
    # Connections close while the sources stop: SIGTERM ends the process within 2 s.
    httpd.stop_serving()
    app.stop()
    httpd.shutdown()
    return 0


def listen(cfg: Config, app: "App", web: "Optional[WebConfigSource]") -> "Front":
    """The HTTP front bound to --web.listen-address, not yet serving; an address it cannot
    bind ends the process as a bad flag does."""
    from exporter.exposition import http

    exposition = app.exposition
    site = http.make_app(exposition.wsgi_app, cfg.telemetry_path, exposition.ready)
    host, port = cfg.listen.host, cfg.listen.port
    try:
        return http.bind(host, port, site, web, cfg.max_requests, ready=site.ready)
    except OSError as err:
        where = f"{http.url_host(host)}:{port}"
        bad_flag(
            "--web.listen-address", f"cannot listen on {where}: {err.strerror or err}"
        )


def handle_signals(done: threading.Event, web: "Optional[WebConfigSource]") -> None:
    """SIGTERM and SIGINT set `done`; SIGHUP re-reads the web config, as Prometheus does."""

    def on_signal(signum: int, _frame: Optional[FrameType]) -> None:
        if signum == signal.SIGHUP:
            what = "re-reading the web config" if web else "no web config to re-read"
            log.info("received SIGHUP, %s", what)
            if web:
                web.reload()
        else:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            done.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)


def wait_for_stop(done: threading.Event, httpd: "Front") -> bool:
    """Until `done` (True) or the HTTP server dies (False, logged)."""
    while not done.wait(1):
        if not httpd.is_alive():
            # A listener that died leaves a process that answers nothing: exit, so the
            # orchestrator restarts it, instead of hanging with the port still bound.
            log.error("the HTTP server stopped unexpectedly; exiting")
            return False
    return True
