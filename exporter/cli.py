"""`shmwatch` (serve /metrics) and `shmwatch check` (one-shot diagnosis)."""
from __future__ import annotations

import logging
import os
import signal
import ssl
import sys
import threading
from typing import List, Optional

from . import __version__
from .config import fail, parse_args


def _setup_logging(level: str) -> None:
    logging.basicConfig(stream=sys.stderr, level=getattr(logging, level.upper(), logging.INFO),
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


def _check_readable(flag: str, path: Optional[str]) -> None:
    if path and not os.access(path, os.R_OK):
        reason = "does not exist" if not os.path.exists(path) else "is not readable"
        fail(flag, f"{path} {reason}")


def serve(argv: List[str]) -> int:
    cfg = parse_args(argv)
    _setup_logging(cfg.log_level)
    from .app import App
    from .server import bind, bound_address, make_app, serve_in_thread, tls_context

    _check_readable("--web.tls-cert-file", cfg.tls_cert_file)
    _check_readable("--web.tls-key-file", cfg.tls_key_file)
    _check_readable("--web.tls-client-ca-file", cfg.tls_client_ca_file)
    context = None
    if cfg.tls_cert_file:
        try:
            context = tls_context(cfg.tls_cert_file, cfg.tls_key_file, cfg.tls_client_ca_file)
        except (ssl.SSLError, OSError) as err:
            flag = "--web.tls-client-ca-file" if cfg.tls_client_ca_file and "verify" in str(err) else \
                "--web.tls-cert-file"
            fail(flag, f"cannot load TLS certificate/key: {err}")
    app = App(cfg)
    try:
        httpd = bind(cfg.listen_host, cfg.listen_port, make_app(app.registry, cfg.telemetry_path, app.exposition.wsgi_app), context)
    except OSError as err:
        fail("--web.listen-address", f"cannot listen on {cfg.listen_host}:{cfg.listen_port}: "
                                     f"{err.strerror or err}")
    done = threading.Event()

    def on_signal(signum, _frame) -> None:
        logging.getLogger("shmwatch").info("received %s, shutting down", signal.Signals(signum).name)
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    app.start()
    serve_in_thread(httpd)
    host, port = bound_address(httpd)
    logging.getLogger("shmwatch").info(
        "shmwatch %s listening on %s://%s:%d%s, watching %s", __version__, "https" if context else "http",
        host, port, cfg.telemetry_path, ", ".join(cfg.shm_mounts))
    while not done.wait(3600):
        pass
    httpd.shutdown()
    httpd.server_close()
    app.stop()
    return 0


def main(argv: Optional[List[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "check":
        from .check import main as check_main
        return check_main(argv[1:])
    return serve(argv)


if __name__ == "__main__":
    sys.exit(main())
