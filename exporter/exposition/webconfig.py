"""`--web.config.file`: exporter-toolkit's web configuration (TLS, client certificates, basic
auth with bcrypt hashes, response headers). What Python's ssl cannot do (unverified client
certificates, cipher and curve lists, client_allowed_sans, inline PEM, rate_limit) is refused
at start-up, not ignored. The files are stat'ed on each new connection: a rotated certificate
serves from the next one on; a change that does not load keeps the last good."""

import base64
import functools
import hashlib
import logging
import os
import re
import ssl
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

import bcrypt
import yaml

from exporter.exposition.render import Families

LOG = logging.getLogger("shmwatch.web")

# Go's tls.ClientAuthType names -> Python's ssl, from no verification to required.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1}
TLS_VERSIONS.update(TLS12=ssl.TLSVersion.TLSv1_2, TLS13=ssl.TLSVersion.TLSv1_3)
# exporter-toolkit accepts exactly these response headers, some with fixed values.
HEADERS = {"Content-Security-Policy": (), "X-Frame-Options": ("deny", "sameorigin")}
HEADERS.update({"X-Content-Type-Options": ("nosniff",), "X-XSS-Protection": ()})
HEADERS["Strict-Transport-Security"] = ()
# A bcrypt hash: variant, cost 04-31, 22 characters of salt and 31 of hash.
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
BCRYPT_WORKERS = 2  # checks at once: a guessing client cannot take every core
BCRYPT_QUEUE = 8  # checks running or waiting; beyond, or a second from one address: 503
TLS, HEADERS_KEY = "tls_server_config", "http_server_config.headers"
SECTIONS = (TLS, "http_server_config", "basic_auth_users", "rate_limit")
TLS_UNSUPPORTED = {"cert", "key", "client_ca", "client_allowed_sans", "cipher_suites"}
TLS_UNSUPPORTED |= {"prefer_server_cipher_suites", "curve_preferences"}


class WebConfigError(ValueError):
    """The web config is invalid; the message says where."""


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str
    key_file: str
    client_ca_file: Optional[str] = None
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"

    def context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = TLS_VERSIONS[self.min_version]
        context.maximum_version = TLS_VERSIONS[self.max_version]
        what = "cert_file/key_file"
        try:
            context.load_cert_chain(self.cert_file, self.key_file)
            what = "client_ca_file"
            if self.client_ca_file:
                context.load_verify_locations(cafile=self.client_ca_file)
        except (ssl.SSLError, OSError) as err:
            raise WebConfigError(f"{TLS}: cannot load {what}: {err}") from None
        context.verify_mode = CLIENT_AUTH[self.client_auth_type]
        return context


TLS_KEYS = tuple(TlsSettings.__dataclass_fields__)
TLS_CHOICES = dict(client_auth_type=CLIENT_AUTH)
TLS_CHOICES.update(min_version=TLS_VERSIONS, max_version=TLS_VERSIONS)


@dataclass(frozen=True)
class WebConfig:
    tls: Optional[TlsSettings] = None
    users: Dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Tuple[Tuple[str, str], ...] = ()


def _section(raw: dict, key: str, allowed=()) -> dict:
    """raw[key] as a mapping ({} when absent), refusing fields not in `allowed` if given."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{key}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed)) if allowed else ()
    if unknown:
        raise WebConfigError(f"{key}: unknown field {', '.join(unknown)}")
    return value


def parse(text: str, base: str = ".") -> WebConfig:
    """The web config's YAML -> WebConfig; WebConfigError names the offending field.
    Relative file names are the web config directory's (`base`), as in exporter-toolkit."""
    try:
        raw = _section({"top level": yaml.safe_load(text)}, "top level", SECTIONS)
    except yaml.YAMLError as err:
        raise WebConfigError(f"not valid YAML: {str(err).splitlines()[0]}") from None
    if "rate_limit" in raw:
        raise WebConfigError("rate_limit is not supported by shmwatch")
    tls, given = None, _section(raw, TLS, (*TLS_KEYS, *TLS_UNSUPPORTED))
    unsupported = ", ".join(sorted(set(given) & TLS_UNSUPPORTED))
    if unsupported:
        use = f"use {', '.join(TLS_KEYS)}"
        raise WebConfigError(f"{TLS}: {unsupported} not supported by shmwatch ({use})")
    if given:  # absent or empty fields: TlsSettings' defaults
        given = {k: given.get(k) or getattr(TlsSettings, k, None) for k in TLS_KEYS}
        auth, ca = given["client_auth_type"], given["client_ca_file"]
        if not given["cert_file"] or not given["key_file"]:
            raise WebConfigError(f"{TLS}: needs both cert_file and key_file")
        if auth in UNVERIFIED_CLIENT_AUTH:
            raise WebConfigError(
                f"{TLS}: client_auth_type {auth} (a client certificate accepted without "
                "verification) is not supported: use RequireAndVerifyClientCert"
            )
        for key, choices in TLS_CHOICES.items():
            if given[key] not in choices:
                value, names = given[key], ", ".join(choices)
                raise WebConfigError(f"{TLS}: invalid {key} {value!r} (one of {names})")
        if auth != "NoClientCert" and not ca:
            raise WebConfigError(f"{TLS}: client_auth_type {auth} needs client_ca_file")
        if ca and auth == "NoClientCert":
            raise WebConfigError(
                f"{TLS}: client_ca_file is set but client_auth_type is NoClientCert "
                "(set client_auth_type: RequireAndVerifyClientCert)"
            )
        if TLS_VERSIONS[given["min_version"]] > TLS_VERSIONS[given["max_version"]]:
            raise WebConfigError(f"{TLS}: min_version is above max_version")
        for key in ("cert_file", "key_file", "client_ca_file"):
            given[key] = given[key] and os.path.join(base, str(given[key]))
        tls = TlsSettings(**given)
    users = {}
    for user, hashed in _section(raw, "basic_auth_users").items():
        hashed = str(hashed or "")
        if not BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(
                f"basic_auth_users: the password of {user!r} is not a bcrypt hash bcrypt "
                "can check (make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n')"
            )
        users[str(user)] = hashed.encode()
    http = _section(raw, "http_server_config", ("headers", "http2"))
    if "http2" in http and not isinstance(http["http2"], bool):  # HTTP/1.1 is served
        raise WebConfigError("http_server_config: http2 must be true or false")
    headers = []
    for name, value in _section(http, "headers").items():
        if name not in HEADERS:
            names = ", ".join(HEADERS)
            raise WebConfigError(f"{HEADERS_KEY}: {name} is not one of {names}")
        allowed, value = HEADERS[name], "" if value is None else str(value)
        if allowed and value and value.lower() not in allowed:
            names = ", ".join(allowed)
            raise WebConfigError(f"{HEADERS_KEY}: {name} must be one of {names}")
        if value:
            headers.append((name, value))
    return WebConfig(tls=tls, users=users, headers=tuple(headers))


class WebConfigSource:
    """--web.config.file's (`path`) or a `fixed` config and its SSLContext, rebuilt when a
    file behind them changes; collects shmwatch_web_config_last_reload_successful."""

    def __init__(self, path: Optional[str] = None, fixed: Optional[WebConfig] = None):
        self.path, self._fixed = path, fixed
        self._lock = threading.Lock()
        self._checking: set = set()  # addresses with a bcrypt check queued or running
        # Threads made on demand: no bcrypt thread while no one authenticates.
        self._pool = ThreadPoolExecutor(BCRYPT_WORKERS, "shmwatch-bcrypt")
        config = self._read()
        self.tls = config.tls is not None  # fixed for the life of the listener
        self.generation = 0  # moves with every reload and recovery (render again)
        self._install(config)

    def _install(self, config: WebConfig) -> None:
        """Serves `config` from now on; raises, changing nothing, when its files do not load."""
        # Stamped before loading: a file replaced meanwhile is loaded again next time.
        stamp = self._current_stamp(config)
        context = config.tls.context() if config.tls else None
        self.config, self.context, self._stamp = config, context, stamp
        self._failed_stamp, self.reload_ok = None, True
        self._good: Dict[bytes, None] = {}  # digests of credentials that passed
        # The dummy hashes checks are padded with, made before the first check needs them.
        costs = [cost(h) for h in config.users.values()]
        for level in range(min(costs, default=0), max(costs, default=-1) + 1):
            self._pool.submit(dummy_hash, level)

    def _read(self) -> WebConfig:
        if not self.path:
            return self._fixed
        try:
            with open(self.path, encoding="utf-8") as f:
                text = f.read()
        except (OSError, ValueError) as err:  # ValueError: saved in another encoding
            reason = getattr(err, "strerror", None) or err
            raise WebConfigError(f"cannot read {self.path}: {reason}") from None
        return parse(text, os.path.dirname(os.path.abspath(self.path)))

    def _current_stamp(self, config: WebConfig) -> tuple:
        tls = config.tls or TlsSettings("", "")
        files = (self.path, tls.cert_file, tls.key_file, tls.client_ca_file)
        stamps = []
        for path in filter(None, files):
            try:
                st = os.stat(path)
                stamps.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamps.append((path, None))
        return tuple(stamps)

    def current(self, force=False) -> Tuple[WebConfig, Optional[ssl.SSLContext]]:
        """The config and context for a new connection, re-read if files changed or `force`."""
        with self._lock:
            stamp = self._current_stamp(self.config)
            if force or stamp not in (self._stamp, self._failed_stamp):
                self._reload(stamp)
            elif stamp == self._stamp and self._failed_stamp not in (None, stamp):
                self._failed_stamp, self.reload_ok = None, True  # the good files back
                self.generation += 1  # the reload metric moved: render again
            return self.config, self.context

    def reload(self) -> None:
        """Re-read the files whether they changed or not (SIGHUP)."""
        self.current(force=True)

    def _reload(self, stamp) -> None:
        self.generation += 1
        try:
            config = self._read()
            if (config.tls is not None) != self.tls:
                raise WebConfigError("turning TLS on or off needs a restart")
            # Fail closed: a file emptied or cut short must not open /metrics to anyone.
            old, dropped = self.config, None
            verified = old.tls and CLIENT_AUTH[old.tls.client_auth_type]
            if old.users and not config.users:
                dropped = "basic authentication"
            elif verified and CLIENT_AUTH[config.tls.client_auth_type] < verified:
                dropped = "client certificate verification"
            if dropped:
                raise WebConfigError(f"it would turn off {dropped} (restart to do so)")
            self._install(config)
        except Exception as err:  # anything, not only WebConfigError: keep serving
            # A rotation in progress fails once; until the next change the last good serves.
            self._failed_stamp, self.reload_ok = stamp, False
            LOG.warning("web config not reloaded, keeping the previous one: %s", err)
            return
        LOG.info("web config reloaded")

    def collect(self):
        out = Families()
        out.add("shmwatch_web_config_last_reload_successful", [], int(self.reload_ok))
        return list(out)

    def authorize(self, config: WebConfig, header: Optional[str], peer: str = ""):
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
        future = self._pool.submit(self._check, config, hashed, secret, key)
        future.add_done_callback(lambda _: self._checking.discard(peer))
        return future

    def _check(self, config: WebConfig, hashed, secret: bytes, key: bytes) -> bool:
        """bcrypt at the file's highest cost for everyone (unknown users against a dummy
        hash; a cheaper hash padded, 2^c + 2^c + ... + 2^(top-1) = 2^top): timing tells
        neither which users exist nor whose hash is cheaper."""
        top = max(cost(h) for h in config.users.values())
        ok = bcrypt.checkpw(secret, hashed or dummy_hash(top)) and hashed is not None
        for level in range(cost(hashed) if hashed else top, top):
            bcrypt.checkpw(secret, dummy_hash(level))
        if ok:
            if len(self._good) >= 1024:  # bounded: users times their passwords in use
                self._good = {}
            self._good[key] = None
        return ok


def cost(hashed: bytes) -> int:
    return int(hashed.split(b"$")[2])  # every hash parse() took reads $2?$<cost>$...


@functools.lru_cache(maxsize=None)
def dummy_hash(level: int) -> bytes:
    return bcrypt.hashpw(b"no such user", bcrypt.gensalt(level))
