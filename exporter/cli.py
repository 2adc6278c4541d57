"""`shmwatch` (serve /metrics) and `shmwatch check` (one-shot diagnosis)."""

from __future__ import annotations

import logging
import os
import resource
import signal
import sys
import threading
from contextlib import suppress
from typing import List, NoReturn, Optional

from exporter import __version__
from exporter.config import parse_args
from exporter.runtime import gc_tuning, logs

log = logging.getLogger("shmwatch")


def fail(flag: str, message: str) -> NoReturn:
    """End start-up with one line naming the flag (for errors found after parsing)."""
    sys.stderr.write(f"shmwatch: error: argument {flag}: {message}\n")
    sys.exit(2)


def _check_readable(flag: str, path: Optional[str]) -> None:
    if path and not os.access(path, os.R_OK):
        reason = "does not exist" if not os.path.exists(path) else "is not readable"
        fail(flag, f"{path} {reason}")


def _web_config(cfg):
    """-> WebConfigSource or None; a bad config ends start-up with one line naming the flag."""
    from exporter.exposition import webconfig as wc

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
        _check_readable("--web.config.file", cfg.web_config_file)
        try:
            return wc.WebConfigSource(path=cfg.web_config_file)
        except wc.WebConfigError as err:
            fail("--web.config.file", f"{cfg.web_config_file}: {err}")
    if not cert:
        return None
    # The old flags are aliases of a web config with only tls_server_config (reloaded too).
    for flag, path in (("cert-file", cert), ("key-file", key), ("client-ca-file", ca)):
        _check_readable(f"--web.tls-{flag}", path)
    client_auth = "RequireAndVerifyClientCert" if ca else "NoClientCert"
    try:
        tls = wc.TlsSettings(cert, key, ca, client_auth)
        source = wc.WebConfigSource(fixed=wc.WebConfig(tls=tls))
    except wc.WebConfigError as err:
        flag = "client-ca-file" if "client_ca_file" in str(err) else "cert-file"
        fail(f"--web.tls-{flag}", f"cannot load TLS certificate/key: {err}")
    log.warning(
        "--web.tls-* flags are deprecated: use --web.config.file (tls_server_config)"
    )
    return source


def _raise_open_files_limit() -> None:
    """The soft limit on open files up to the hard one, as a Go program (node_exporter)
    starts: on a large node the kept cgroup files and the connections outgrow 1,024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        with suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def serve(argv: List[str]) -> int:
    cfg = parse_args(argv)
    logs.setup(cfg.log_level, cfg.log_format)
    from exporter.app import App
    from exporter.exposition import http

    gc_tuning.tune()
    _raise_open_files_limit()
    web = _web_config(cfg)
    app = App(cfg, web=web)
    wsgi = http.make_app(app.exposition.wsgi_app, cfg.telemetry_path)
    host, port = cfg.listen_host, cfg.listen_port
    try:
        httpd = http.bind(host, port, wsgi, web, cfg.max_requests)
    except OSError as err:
        where = f"{http.url_host(host)}:{port}: {err.strerror or err}"
        fail("--web.listen-address", f"cannot listen on {where}")
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        done.set()

    def on_hangup(_signum, _frame) -> None:  # as Prometheus: re-read the web config
        what = "re-reading the web config" if web else "no web config to re-read"
        log.info("received SIGHUP, %s", what)
        if web:
            web.reload()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hangup)
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
    httpd.shutdown()
    app.stop()
    return 0


def collect_once(cfg, timeout: float):
    """`shmwatch check`'s model: one run of every source (each on its own thread, so a hung
    GPU is bounded by its timeout), then the model. No inotify: nothing here waits for events."""
    from exporter.app import App

    # recent kills: the kernel log ring from its start
    app = App(cfg, kmsg_from_start=True)
    with suppress(OSError, ValueError):  # reported by the discovery source's own run
        app.discovery.collect()
    app.sampler.start()
    app.sampler.wait_for_first_run(timeout)
    model = app.step.current()
    app.sampler.stopping.set()
    # A source still running at check's deadline is left to it: closing it (nvmlShutdown
    # while a GPU that fell off the bus holds the driver) could block past the deadline.
    busy = set(app.sampler.busy())
    for source in app.sources:
        if source.name not in busy:
            source.close()
    return model


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        from exporter.check.report import main as check_main

        return check_main(argv[1:], collect_once)
    return serve(argv)
