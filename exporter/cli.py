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
from typing import List, NoReturn, Optional

from exporter import __version__
from exporter.app import App
from exporter.config import Config, build_parser, parse_args
from exporter.exposition import http
from exporter.exposition import webconfig as wc
from exporter.exposition import webschema as ws

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


def fail(flag: str, message: str) -> NoReturn:  # as a bad flag value, after parsing
    build_parser().error(f"argument {flag}: {message}")


def _web_config(cfg: Config) -> Optional[wc.WebConfigSource]:
    """-> WebConfigSource or None; a bad config ends start-up with one line naming the flag."""
    cert, key, ca = cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file
    if cfg.web_config_file and (cert or key or ca):
        fail(
            "--web.config.file",
            "give it or the deprecated --web.tls-* flags, not both "
            "(move them to tls_server_config)",
        )
    if (key or ca) and not cert:
        flag = "key-file" if key else "client-ca-file"
        fail(f"--web.tls-{flag}", "needs --web.tls-cert-file too")
    if cert and not key:
        fail("--web.tls-cert-file", "needs --web.tls-key-file too")
    if cfg.web_config_file:
        try:
            return wc.WebConfigSource(path=cfg.web_config_file)
        except ws.WebConfigError as err:  # its line starts with the file's name
            fail("--web.config.file", str(err))
    return _deprecated_tls(cert, key, ca) if cert else None


def _deprecated_tls(cert: str, key: str, ca: Optional[str]) -> wc.WebConfigSource:
    """The old flags: aliases of a web config with only tls_server_config (reloaded too)."""
    client_auth = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    try:
        tls = ws.TlsSettings(cert, key, ca, client_auth)
        source = wc.WebConfigSource(fixed=ws.WebConfig(tls=tls))
    except ws.WebConfigError as err:
        flags = {".key_file": "key-file", "client_ca_file": "client-ca-file"}
        flag = next((f for field, f in flags.items() if field in str(err)), "cert-file")
        fail(f"--web.tls-{flag}", f"cannot load TLS certificate/key: {err}")
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


def collect_once(cfg, timeout: float):
    """`shmwatch check`'s model: one run of every source, the kernel log from its start."""
    app = App(cfg, kmsg_from_start=True)
    app.start(watch=False)
    app.sampler.wait_for_first_run(timeout)
    model = app.step.current()
    app.stop(wait=0)  # a source still running at check's deadline is left to it
    return model


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

    def thread_hook(args: "threading.ExceptHookArgs") -> None:
        if args.exc_type is not SystemExit:
            name = args.thread.name if args.thread else "?"
            exc = args.exc_value
            exc_info = (args.exc_type, exc, args.exc_traceback) if exc else None
            log.error("uncaught exception in thread %s", name, exc_info=exc_info)

    threading.excepthook = thread_hook
    sys.excepthook = lambda *exc: log.error("uncaught exception", exc_info=exc)
    sys.unraisablehook = unraisable_hook


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        from exporter.check.report import main as check_main

        return check_main(argv[1:], collect_once)
    cfg = parse_args(argv)
    log_to_stderr(cfg.log_format, cfg.log_level)
    tune_process()
    web = _web_config(cfg)
    app = App(cfg, web=web)
    exposition = app.exposition
    site = http.make_app(exposition.wsgi_app, cfg.telemetry_path, exposition.ready)
    try:
        host, port, most = cfg.listen_host, cfg.listen_port, cfg.max_requests
        httpd = http.bind(host, port, site, web, most, ready=site.ready)
    except OSError as err:
        where = f"{http.url_host(cfg.listen_host)}:{cfg.listen_port}"
        fail("--web.listen-address", f"cannot listen on {where}: {err.strerror or err}")
    return serve(cfg, app, httpd, web)


def serve(
    cfg: Config, app: App, httpd: http.Front, web: Optional[wc.WebConfigSource]
) -> int:
    """Serves until SIGTERM or SIGINT (exit 0, within 2 s) or the HTTP server dies (1)."""
    done = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:  # as Prometheus: re-read the web config
            what = "re-reading the web config" if web else "no web config to re-read"
            log.info("received SIGHUP, %s", what)
            if web:
                web.reload()
        else:
            log.info("received %s, shutting down", signal.Signals(signum).name)
            done.set()

    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, on_signal)
    app.start()
    httpd.start()
    scheme = "https" if web and web.tls else "http"
    host, port = http.url_host(httpd.server_address[0]), httpd.server_address[1]
    mounts = ", ".join(cfg.shm_mounts)
    where = f"{scheme}://{host}:{port}{cfg.telemetry_path}"
    log.info("shmwatch %s listening on %s, watching %s", __version__, where, mounts)
    while not done.wait(1):
        if not httpd.is_alive():
            # A listener that died leaves a process that answers nothing: exit, so the
            # orchestrator restarts it, instead of hanging with the port still bound.
            log.error("the HTTP server stopped unexpectedly; exiting")
            app.stop()
            return 1
    # Connections close while the sources stop: SIGTERM ends the process within 2 s.
    httpd.stop_serving()
    app.stop()
    httpd.shutdown()
    return 0
