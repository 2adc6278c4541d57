"""`--web.config.file` served: new connections take the last good config and SSLContext,
swapped whole by a watcher thread that stats the files every `interval` s (and re-reads
them at SIGHUP). Connections read no file and wait for no bcrypt: each check runs on a
daemon thread against its own user's hash."""

import base64
import hashlib
import logging
import os
import ssl
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, Optional, Set, Tuple, Union

import bcrypt

from exporter.exposition.render import Families, Family
from exporter.exposition.webschema import CLIENT_AUTH, WebConfig, WebConfigError
from exporter.exposition.webschema import TlsSettings, parse, read_file

LOG = logging.getLogger("shmwatch.web")

BCRYPT_WORKERS = 2  # checks at once: a guessing client cannot take every core
BCRYPT_QUEUE = 8  # checks running or waiting; beyond, or a second from one address: 503
# What an unknown user is checked against (cost 10, as exporter-toolkit's): the work of a
# user's cost-10 hash, and no match ever counts. Its password is "no such user".
DUMMY_HASH = b"$2b$10$3kBcrrJsSSGEFy7VMWBu6OyI6G0QuqUUDbqfAlj7qz7GtQ8EIGI8q"
# The files' (path, mtime, size, inode) when read, compared whole: a change is a reload.
Stamp = Tuple[Tuple[str, int, int, int], ...]
Checker = Callable[[bytes, bytes], bool]  # bcrypt.checkpw: (password, hash) -> match
Verdict = Union[bool, None, Future[bool]]


@dataclass(frozen=True)
class Served:
    """What new connections take; replaced whole, never changed."""

    config: WebConfig
    context: Optional[ssl.SSLContext]
    stamp: Stamp


def stamp_of(*paths: Optional[str]) -> Stamp:
    stamps = []
    for path in filter(None, paths):
        try:
            st = os.stat(path)
            stamps.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
        except OSError:
            stamps.append((path, -1, -1, -1))
    return tuple(stamps)


def files_of(config: WebConfig) -> Tuple[Optional[str], ...]:
    tls = config.tls or TlsSettings("", "")
    return tls.cert_file, tls.key_file, tls.client_ca_file


def weakened(old: WebConfig, new: WebConfig) -> Optional[str]:
    """What `new` would turn off that `old` enforces (fail closed: a file emptied or cut
    short must not open /metrics to anyone), or None."""
    if (new.tls is None) != (old.tls is None):
        return "turning TLS on or off needs a restart"
    if old.users and not new.users:
        return "it would turn off basic authentication (restart to do so)"
    verified = CLIENT_AUTH[old.tls.client_auth_type] if old.tls else ssl.CERT_NONE
    if new.tls and CLIENT_AUTH[new.tls.client_auth_type] < verified:
        return "it would turn off client certificate verification (restart to do so)"
    return None


class WebConfigSource:
    """--web.config.file's (`path`) or a `fixed` config and its SSLContext; start() watches
    the files; collects shmwatch_web_config_last_reload_successful. http.py's interface:
    `tls`, current() and authorize(), none of which reads a file or waits."""

    def __init__(
        self,
        path: Optional[str] = None,
        fixed: Optional[WebConfig] = None,
        checkpw: Checker = bcrypt.checkpw,
        interval: float = 0.5,
    ):
        self.path, self._fixed = path, fixed or WebConfig()
        self._checkpw, self.interval = checkpw, interval
        self._lock = threading.Lock()  # guards _checking only: held for no I/O
        # Addresses with a bcrypt check queued or running; BCRYPT_WORKERS of them run.
        self._checking: Set[str] = set()
        self._bcrypt = threading.BoundedSemaphore(BCRYPT_WORKERS)
        self._wake, self._forced, self._stopping = threading.Event(), False, False
        self._failed_stamp: Optional[Stamp] = None
        self.reload_ok, self.generation = True, 0  # generation: render /metrics again
        self._install(self._load())
        self.tls = self.served.config.tls is not None  # for the life of the listener

    def _load(self) -> Served:
        """Everything a connection will use, read and checked now. Each file is stamped before
        it is read: one replaced meanwhile is read again at the next look."""
        config, stamp = self._fixed, stamp_of(self.path)
        try:
            if self.path is not None:
                text = read_file(self.path).decode("utf-8")
                config = parse(text, os.path.dirname(os.path.abspath(self.path)))
            stamp += stamp_of(*files_of(config))
            context = config.tls.context() if config.tls else None
        except UnicodeDecodeError:
            raise WebConfigError(f"{self.path}: not UTF-8 text") from None
        except WebConfigError as err:  # its line starts with the file's name
            raise WebConfigError(f"{self.path}: {err}" if self.path else err) from None
        return Served(config, context, stamp)

    def _install(self, served: Served) -> None:
        self.served = served
        self._good: Dict[bytes, None] = {}  # digests of credentials that passed

    @property
    def config(self) -> WebConfig:
        return self.served.config

    def current(self) -> Tuple[WebConfig, Optional[ssl.SSLContext]]:
        """The config and context for a new connection: the last good, never re-read here."""
        served = self.served
        return served.config, served.context

    def start(self) -> None:
        """Watches the files on a daemon thread of its own until stop()."""
        name = "shmwatch-webconfig"
        threading.Thread(target=self._watch, name=name, daemon=True).start()

    def stop(self) -> None:
        """The watcher ends at its next look. No wake-up: the main thread must hold no
        lock of _wake's that SIGHUP's handler (reload(), on that thread) could wait for."""
        self._stopping = True

    def reload(self) -> None:
        """Re-read the files whether they changed or not (SIGHUP), on the watcher's thread."""
        self._forced = True
        self._wake.set()

    def _watch(self) -> None:
        while not self._stopping:
            self._wake.wait(self.interval)
            self._wake.clear()
            forced, self._forced = self._forced, False
            if not self._stopping:
                self.poll(forced)

    def poll(self, force: bool = False) -> None:
        """One look at the files (the watcher's, or a test's): reloads when one changed."""
        served = self.served
        stamp = stamp_of(self.path, *files_of(served.config))
        if force or stamp not in (served.stamp, self._failed_stamp):
            self._reload(stamp)
        elif stamp == served.stamp and self._failed_stamp is not None:
            self._failed_stamp, self.reload_ok = None, True  # the good files back
            self.generation += 1

    def _reload(self, stamp: Stamp) -> None:
        self.generation += 1
        try:
            served = self._load()
            refused = weakened(self.served.config, served.config)
            if refused:
                raise WebConfigError(refused)
        except Exception as err:  # anything, not only WebConfigError: keep serving
            # A rotation in progress fails once; until the next change the last good serves.
            self._failed_stamp, self.reload_ok = stamp, False
            LOG.warning("web config not reloaded, keeping the previous one: %s", err)
            return
        self._install(served)
        self._failed_stamp, self.reload_ok = None, True
        LOG.info("web config reloaded")

    def collect(self) -> Iterable[Family]:
        out = Families()
        out.add("shmwatch_web_config_last_reload_successful", [], int(self.reload_ok))
        return out.__iter__()

    def authorize(
        self, config: WebConfig, header: Optional[str], peer: str = ""
    ) -> Verdict:
        """True, False, a Future of either while bcrypt runs, or None when bcrypt is busy
        (not a wrong password). Successes are remembered by a digest (a scrape pays bcrypt
        once), failures are not (a guessing client cannot evict them)."""
        if not config.users:
            return True
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True).decode()
            user, password = decoded.split(":", 1)
        except ValueError:  # not base64, not UTF-8, no colon
            return False
        hashed = config.users.get(user)
        # bcrypt reads 72 bytes of a password, as htpasswd and Go's bcrypt read it.
        secret = password.encode()[:72]
        material = b"\0".join((user.encode(), hashed or b"", secret))
        key = hashlib.sha256(material).digest()
        if key in self._good:
            return True
        with self._lock:
            if len(self._checking) >= BCRYPT_QUEUE or peer in self._checking:
                return None  # busy: do not pile checks up
            self._checking.add(peer)
        future: Future[bool] = Future()
        future.add_done_callback(lambda _: self._checking.discard(peer))
        check = (future, hashed, secret, key)
        name = "shmwatch-bcrypt"
        thread = threading.Thread(
            target=self._check, args=check, name=name, daemon=True
        )
        try:
            thread.start()
        except RuntimeError as err:  # no thread to be had: busy this once, not for good
            LOG.warning("cannot start a bcrypt check: %s", err)
            with self._lock:
                self._checking.discard(peer)
            return None
        return future

    def _check(
        self, future: "Future[bool]", hashed: Optional[bytes], secret: bytes, key: bytes
    ) -> None:
        """bcrypt against the user's own hash, at its cost, as exporter-toolkit checks (an
        unknown user against DUMMY_HASH, which lets no one in); BCRYPT_WORKERS at once, on
        daemon threads: a ThreadPoolExecutor's are joined at exit, holding SIGTERM up."""
        with self._bcrypt:
            try:
                matched = self._checkpw(secret, hashed or DUMMY_HASH)
            except Exception as err:  # the connection answers 500
                future.set_exception(err)
                return
        if matched and hashed is not None:
            if len(self._good) >= 1024:  # bounded: users times their passwords in use
                self._good = {}
            self._good[key] = None
        future.set_result(matched and hashed is not None)
