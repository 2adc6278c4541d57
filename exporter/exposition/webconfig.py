"""`--web.config.file`: exporter-toolkit's web configuration (TLS, client certificates, basic
auth with bcrypt hashes, response headers), as every Go exporter takes it. What Python's ssl
cannot do (a client certificate taken unverified, cipher and curve lists, client_allowed_sans,
inline PEM, rate_limit) is refused at start-up with a message, not ignored.

The files are stat'ed on each new connection: a rotated certificate serves from the next one
on; a change that does not load (a key written before its certificate) keeps the last good.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
import os
import ssl
import threading
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import yaml

LOG = logging.getLogger("shmwatch.web")

# Go's tls.ClientAuthType names -> what Python's ssl can do with them.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
# exporter-toolkit accepts exactly these response headers, some with fixed values.
HEADERS = {
    "Content-Security-Policy": None,
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-Content-Type-Options": ("nosniff",),
    "X-XSS-Protection": None,
    "Strict-Transport-Security": None,
}
TLS_KEYS = tuple(
    "cert_file key_file client_ca_file client_auth_type min_version max_version".split()
)
TLS_UNSUPPORTED = set(
    "cert key client_ca client_allowed_sans cipher_suites prefer_server_cipher_suites "
    "curve_preferences".split()
)


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

    def files(self) -> List[str]:
        return [f for f in (self.cert_file, self.key_file, self.client_ca_file) if f]

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
            raise WebConfigError(
                f"tls_server_config: cannot load {what}: {err}"
            ) from None
        context.verify_mode = CLIENT_AUTH[self.client_auth_type]
        return context


@dataclass(frozen=True)
class WebConfig:
    tls: Optional[TlsSettings] = None
    users: Dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Tuple[Tuple[str, str], ...] = ()


def _mapping(value, where: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise WebConfigError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _no_unknown(raw: dict, allowed, where: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise WebConfigError(f"{where}unknown field {', '.join(unknown)}")


def parse_tls(raw: dict, base: str) -> TlsSettings:
    def bad(message: str) -> WebConfigError:
        return WebConfigError("tls_server_config: " + message)

    unsupported = sorted(set(raw) & TLS_UNSUPPORTED)
    if unsupported:
        use = ", ".join(TLS_KEYS)
        raise bad(f"{', '.join(unsupported)} not supported by shmwatch (use {use})")
    _no_unknown(raw, TLS_KEYS, "tls_server_config: ")
    if not raw.get("cert_file") or not raw.get("key_file"):
        raise bad("needs both cert_file and key_file")
    auth = raw.get("client_auth_type") or "NoClientCert"
    if auth in UNVERIFIED_CLIENT_AUTH:
        raise bad(
            f"client_auth_type {auth} (a client certificate accepted without "
            "verification) is not supported: use RequireAndVerifyClientCert"
        )
    if auth not in CLIENT_AUTH:
        raise bad(
            f"invalid client_auth_type {auth!r} (one of {', '.join(CLIENT_AUTH)})"
        )
    ca = raw.get("client_ca_file")
    if auth != "NoClientCert" and not ca:
        raise bad(f"client_auth_type {auth} needs client_ca_file")
    if ca and auth == "NoClientCert":
        raise bad(
            "client_ca_file is set but client_auth_type is NoClientCert "
            "(set client_auth_type: RequireAndVerifyClientCert)"
        )
    versions = []
    for key, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        version = raw.get(key) or default
        if version not in TLS_VERSIONS:
            raise bad(f"invalid {key} {version!r} (one of {', '.join(TLS_VERSIONS)})")
        versions.append(version)
    if TLS_VERSIONS[versions[0]] > TLS_VERSIONS[versions[1]]:
        raise bad("min_version is above max_version")
    # Relative file names are the web config directory's, as in exporter-toolkit (join
    # keeps an absolute name as it is).
    names = (raw["cert_file"], raw["key_file"], ca)
    paths = [os.path.join(base, str(name)) if name else None for name in names]
    return TlsSettings(*paths, auth, *versions)


def parse(text: str, base: str = ".") -> WebConfig:
    """The web config's YAML -> WebConfig; WebConfigError names the offending field."""
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise WebConfigError(f"not valid YAML: {str(err).splitlines()[0]}") from None
    raw = _mapping(raw, "top level")
    if "rate_limit" in raw:
        raise WebConfigError("rate_limit is not supported by shmwatch")
    _no_unknown(
        raw, ("tls_server_config", "http_server_config", "basic_auth_users"), ""
    )
    tls_raw = _mapping(raw.get("tls_server_config"), "tls_server_config")
    tls = parse_tls(tls_raw, base) if tls_raw else None

    users = {}
    raw_users = _mapping(raw.get("basic_auth_users"), "basic_auth_users")
    for user, hashed in raw_users.items():
        hashed = str(hashed or "")
        if not hashed.startswith(("$2a$", "$2b$", "$2y$")) or len(hashed) != 60:
            raise WebConfigError(
                f"basic_auth_users: the password of {user!r} is not a bcrypt hash "
                "(make one with: htpasswd -nBC 10 \"\" | tr -d ':\\n')"
            )
        users[str(user)] = hashed.encode()

    http = _mapping(raw.get("http_server_config"), "http_server_config")
    _no_unknown(http, ("headers", "http2"), "http_server_config: ")
    if "http2" in http and not isinstance(http["http2"], bool):  # HTTP/1.1 is served
        raise WebConfigError("http_server_config: http2 must be true or false")
    headers = []
    raw_headers = _mapping(http.get("headers"), "http_server_config.headers")
    for name, value in raw_headers.items():
        if name not in HEADERS:
            raise WebConfigError(
                f"http_server_config.headers: {name} is not one of {', '.join(HEADERS)}"
            )
        allowed = HEADERS[name]
        value = "" if value is None else str(value)
        if allowed and value and value.lower() not in allowed:
            raise WebConfigError(
                f"http_server_config.headers: {name} must be one of {', '.join(allowed)}"
            )
        if value:
            headers.append((name, value))
    return WebConfig(tls=tls, users=users, headers=tuple(headers))


class WebConfigSource:
    """The current web config and its SSLContext, rebuilt when a file behind them changes:
    --web.config.file's (`path`) or a `fixed` one (the old --web.tls-* flags' files)."""

    def __init__(self, path: Optional[str] = None, fixed: Optional[WebConfig] = None):
        self.path, self._fixed = path, fixed
        self._lock = threading.Lock()
        self._auth_cache: Dict[bytes, bool] = {}
        # bcrypt is slow on purpose: a client guessing passwords gets at most this many
        # checks at once, so it cannot take every core from the collectors.
        self._bcrypt_slots = threading.BoundedSemaphore(2)
        self._failed_stamp = None
        self.config = self._read()
        self.context = self.config.tls.context() if self.config.tls else None
        self._stamp = self._current_stamp(self.config)
        self.tls = self.config.tls is not None  # fixed for the life of the listener

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
        files = ([self.path] if self.path else []) + (
            config.tls.files() if config.tls else []
        )
        stamps = []
        for path in files:
            try:
                st = os.stat(path)
                stamps.append((path, st.st_mtime_ns, st.st_size, st.st_ino))
            except OSError:
                stamps.append((path, None))
        return tuple(stamps)

    def current(self) -> Tuple[WebConfig, Optional[ssl.SSLContext]]:
        """The config and context to use for a new connection (re-read when files changed)."""
        with self._lock:
            stamp = self._current_stamp(self.config)
            if stamp != self._stamp and stamp != self._failed_stamp:
                self._reload(stamp)
            return self.config, self.context

    def _reload(self, stamp) -> None:
        try:
            config = self._read()
            if (config.tls is not None) != self.tls:
                raise WebConfigError("turning TLS on or off needs a restart")
            # Stamped before the certificate is loaded: a file replaced while we load it
            # differs from this stamp, and is loaded again on the next connection.
            new_stamp = self._current_stamp(config)
            context = config.tls.context() if config.tls else None
        except Exception as err:  # anything, not only WebConfigError: keep serving
            # A rotation in progress (key written, certificate not yet) fails here once;
            # the next change tries again. Until then the last good config serves.
            self._failed_stamp = stamp
            LOG.warning("web config not reloaded, keeping the previous one: %s", err)
            return
        self.config, self.context = config, context
        self._stamp = new_stamp
        self._failed_stamp = None
        self._auth_cache.clear()
        LOG.info("web config reloaded")

    def authorized(self, config: WebConfig, header: Optional[str]) -> bool:
        if not config.users:
            return True
        if not header or header[:6].lower() != "basic ":
            return False
        try:
            decoded = base64.b64decode(header[6:].strip(), validate=True).decode()
        except ValueError:  # not base64, not UTF-8
            return False
        user, sep, password = decoded.partition(":")
        if not sep:
            return False
        hashed = config.users.get(user)
        # bcrypt costs ~70 ms at cost 10: remember outcomes (keyed by a digest, never the
        # password itself), as exporter-toolkit does, so a scrape every 15 s pays it once.
        key = hashlib.sha256(
            b"\0".join((user.encode(), hashed or b"", password.encode()))
        ).digest()
        cached = self._auth_cache.get(key)
        if cached is not None:
            return cached
        import bcrypt

        # Too many checks queued: refuse rather than pile up threads.
        if not self._bcrypt_slots.acquire(timeout=10):
            return False
        try:
            # Every hash parse() accepted reads $2?$<cost>$...
            cost = max(h.split(b"$")[2] for h in config.users.values())
            dummy = hashed or _dummy_hash(cost)
            ok = bcrypt.checkpw(password.encode(), dummy) and hashed is not None
        except ValueError:
            ok = False
        finally:
            self._bcrypt_slots.release()
        if len(self._auth_cache) > 1024:  # a password-guessing client cannot grow it
            self._auth_cache.clear()
        self._auth_cache[key] = ok
        return ok


@functools.lru_cache(maxsize=None)
def _dummy_hash(cost: bytes) -> bytes:
    """A hash to check unknown users against, of the configured users' highest cost: an
    unknown user name costs what a wrong password does, so timing does not tell who exists."""
    import bcrypt

    return bcrypt.hashpw(b"no such user", bcrypt.gensalt(min(max(int(cost), 4), 31)))


# Paths that answer without credentials: a readiness probe has none, and "OK" tells nothing.
OPEN_PATHS = ("/-/healthy",)
CHALLENGE = [
    ("Content-Type", "text/plain; charset=utf-8"),
    ("WWW-Authenticate", 'Basic realm="shmwatch"'),
]


def wrap_app(app: Callable, source: WebConfigSource) -> Callable:
    """WSGI middleware: the configured response headers on every answer, basic auth on all
    but OPEN_PATHS (401 with a WWW-Authenticate challenge when it fails)."""

    def guarded(environ, start_response):
        config, _ = source.current()

        def with_headers(status, headers, exc_info=None):
            return start_response(status, [*headers, *config.headers], exc_info)

        if environ.get("PATH_INFO", "/") not in OPEN_PATHS and not source.authorized(
            config, environ.get("HTTP_AUTHORIZATION")
        ):
            with_headers("401 Unauthorized", CHALLENGE)
            return [b"Unauthorized\n"]
        return app(environ, with_headers)

    return guarded
