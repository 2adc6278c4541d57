"""The web config (exporter-toolkit's format) read as untrusted input: only regular files of
at most 1 MiB; YAML without anchors, aliases or a key given twice, within MAX_YAML_NODES;
every field's type checked. A WebConfigError is one line naming the field. What Python's ssl
cannot do, and rate_limit, are refused rather than ignored."""

import contextlib
import os
import re
import ssl
import stat
from dataclasses import dataclass, field
from typing import Any, Dict, Hashable, Iterator, List, Mapping, Optional, Set, Tuple

import yaml

MAX_FILE_BYTES = 1 << 20  # a web config, a certificate chain, a CA bundle: far smaller
# A user is two nodes; a web config nests 3 deep. Pure-Python YAML takes 13 s for 1 MiB
# of nodes, and nesting beyond the recursion limit raises RecursionError.
MAX_YAML_NODES, MAX_YAML_DEPTH = 10_000, 16
# A bcrypt check costs 2^cost rounds: 10 (htpasswd -C's default) takes about 0.1 s of a
# core, 14 sixteen times that, 31 days.
MAX_BCRYPT_COST = 14
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
HEADERS: Dict[str, Tuple[str, ...]] = {"X-Frame-Options": ("deny", "sameorigin")}
HEADERS.update({"X-Content-Type-Options": ("nosniff",), "X-XSS-Protection": ()})
HEADERS.update({"Content-Security-Policy": (), "Strict-Transport-Security": ()})
# A header value as RFC 9110's field-value (Go's httpguts.ValidHeaderFieldValue, less the
# obs-text it keeps for old peers): visible ASCII, spaces and tabs only between. Anything
# else breaks the answer (CR LF: a header of the file's choosing; U+2014: not latin-1).
FIELD_VALUE = re.compile(r"[\x21-\x7e](?:[\x21-\x7e \t]*[\x21-\x7e])?")
# A bcrypt hash: variant, cost 04-31, 22 characters of salt and 31 of hash.
BCRYPT_HASH = re.compile(r"\$2[aby]\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")
TLS, USERS, HTTP = "tls_server_config", "basic_auth_users", "http_server_config"
HEADERS_KEY = f"{HTTP}.headers"
# exporter-toolkit's fields (web/tls_config.go), each with its YAML type; null: not given.
TOP_LEVEL = {TLS: dict, HTTP: dict, USERS: dict, "rate_limit": dict}
TLS_FIELDS: Dict[str, type] = dict(cert_file=str, key_file=str, client_ca_file=str)
TLS_FIELDS.update(client_auth_type=str, min_version=str, max_version=str)
TLS_FIELDS.update(cert=str, key=str, client_ca=str, prefer_server_cipher_suites=bool)
TLS_FIELDS.update(cipher_suites=list, curve_preferences=list, client_allowed_sans=list)
HTTP_FIELDS = dict(http2=bool, headers=dict)
TLS_UNSUPPORTED = {"cert", "key", "client_ca", "client_allowed_sans", "cipher_suites"}
TLS_UNSUPPORTED |= {"prefer_server_cipher_suites", "curve_preferences"}
EXPECTED = {str: "a string", bool: "true or false", dict: "a mapping", list: "a list"}
KINDS = {**EXPECTED, bool: "a boolean", int: "a number", float: "a number"}
# What a path is when it is not a regular file, for the line that refuses it.
FILE_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device"}
FILE_KINDS.update({stat.S_IFBLK: "a block device", stat.S_IFDIR: "a directory"})
FILE_KINDS.update({stat.S_IFSOCK: "a socket", stat.S_IFREG: ""})


class WebConfigError(ValueError):
    """The web config is invalid; the message (one line) says where."""


def shown(text: object) -> str:
    """A name from the file, safe in a one-line message: repr() when it holds a control."""
    return str(text) if str(text).isprintable() else repr(text)


def refuse_unless_regular(mode: int) -> None:
    kind = FILE_KINDS.get(stat.S_IFMT(mode), "not a file")
    if kind:
        raise WebConfigError(f"{kind}, not a regular file")


def read_file(path: str) -> bytes:
    """A regular file's bytes, at most MAX_FILE_BYTES. Anything else is refused before it
    is opened (a device may act on open: /dev/watchdog), and after: O_NONBLOCK, so a FIFO
    swapped in meanwhile does not block the open, and fstat sees what was opened."""
    try:
        refuse_unless_regular(os.stat(path).st_mode)
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        try:
            return read_regular(fd)
        finally:
            os.close(fd)
    except OSError as err:
        raise WebConfigError(err.strerror or str(err)) from None


def read_regular(fd: int) -> bytes:
    """What `fd` holds, refused if it is not a regular file or is (or grows) over
    MAX_FILE_BYTES: one byte more is read, never more than that."""
    info = os.fstat(fd)
    refuse_unless_regular(info.st_mode)
    chunks: List[bytes] = []
    size = 0
    while info.st_size <= MAX_FILE_BYTES and size <= MAX_FILE_BYTES:
        chunk = os.read(fd, MAX_FILE_BYTES + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
    raise WebConfigError(f"over {MAX_FILE_BYTES >> 20} MiB")


@contextlib.contextmanager
def in_memory(data: bytes) -> Iterator[str]:
    """A path OpenSSL can open holding exactly `data` (a memfd: nothing written to a disk,
    and nothing can change or block between our read and OpenSSL's)."""
    fd = os.memfd_create("shmwatch-tls", os.MFD_CLOEXEC)
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def read_field(path: str, where: str) -> bytes:
    try:
        return read_file(path)
    except WebConfigError as err:
        raise WebConfigError(f"{where}: cannot load {shown(path)}: {err}") from None


@dataclass(frozen=True)
class TlsSettings:
    cert_file: str
    key_file: str
    client_ca_file: Optional[str] = None
    client_auth_type: str = "NoClientCert"
    min_version: str = "TLS12"
    max_version: str = "TLS13"

    def context(self) -> ssl.SSLContext:
        """An SSLContext from the files as they are now, each read as read_file() reads."""
        cert = read_field(self.cert_file, f"{TLS}.cert_file")
        key = read_field(self.key_file, f"{TLS}.key_file")
        ca_file = self.client_ca_file
        ca = ca_file and read_field(ca_file, f"{TLS}.client_ca_file")
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.minimum_version = TLS_VERSIONS[self.min_version]
        context.maximum_version = TLS_VERSIONS[self.max_version]
        what = "cert_file/key_file"
        try:
            with in_memory(cert) as cert_path, in_memory(key) as key_path:
                context.load_cert_chain(cert_path, key_path)
            what = "client_ca_file"
            if ca:
                with in_memory(ca) as ca_path:
                    context.load_verify_locations(cafile=ca_path)
        except (ssl.SSLError, OSError) as err:
            raise WebConfigError(f"{TLS}: cannot load {what}: {err}") from None
        context.verify_mode = CLIENT_AUTH[self.client_auth_type]
        return context


TLS_KEYS = tuple(TlsSettings.__dataclass_fields__)
TLS_CHOICES: Dict[str, Mapping[str, object]] = dict(client_auth_type=CLIENT_AUTH)
TLS_CHOICES.update(min_version=TLS_VERSIONS, max_version=TLS_VERSIONS)


@dataclass(frozen=True)
class WebConfig:
    tls: Optional[TlsSettings] = None
    users: Dict[str, bytes] = field(default_factory=dict)  # user -> bcrypt hash
    headers: Tuple[Tuple[str, str], ...] = ()


class StrictLoader(yaml.SafeLoader):
    """YAML's safe subset without what a web config never needs: anchors and aliases (how
    500 bytes ask for gigabytes), a key given twice in a mapping (yaml.v2's UnmarshalStrict
    refuses it too), more than MAX_YAML_NODES nodes or MAX_YAML_DEPTH levels."""

    nodes = depth = 0

    def compose_node(self, parent: Optional[yaml.Node], index: int) -> Any:
        event = self.peek_event()  # type: ignore[no-untyped-call]
        line = f"line {event.start_mark.line + 1}"
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            raise WebConfigError(f"{line}: YAML anchors and aliases are not accepted")
        self.nodes, self.depth = self.nodes + 1, self.depth + 1
        if self.nodes > MAX_YAML_NODES or self.depth > MAX_YAML_DEPTH:
            limits = f"{MAX_YAML_NODES} nodes, {MAX_YAML_DEPTH} levels"
            raise WebConfigError(
                f"{line}: more YAML than a web config holds ({limits})"
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> Any:
        mapping = super().construct_mapping(node, deep)
        seen: Set[Hashable] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise WebConfigError(f"line {line}: {shown(key)} is given twice")
            seen.add(key)
        return mapping


def typed(value: Any, want: type, where: str) -> Any:
    """`value` when it is None (not given) or a `want` (no field wants a number, which a
    bool would be too)."""
    if value is None or isinstance(value, want):
        return value
    got = KINDS.get(type(value), f"a {type(value).__name__}")
    raise WebConfigError(f"{where}: must be {EXPECTED[want]}, got {got}")


def fields(value: object, where: str, schema: Mapping[str, type]) -> Dict[Any, Any]:
    """`value` as a mapping ({} when null) of the fields `schema` names, each of its type;
    `where` names the mapping ("" at the top level)."""
    mapping: Dict[Any, Any] = typed(value, dict, where or "top level") or {}
    unknown = ", ".join(sorted(shown(key) for key in set(mapping) - set(schema)))
    if unknown:
        raise WebConfigError(f"{where or 'top level'}: unknown field {unknown}")
    for key, item in mapping.items():
        typed(item, schema[key], f"{where}.{key}" if where else key)
    return mapping


def parse(text: str, base: str = ".") -> WebConfig:
    """The web config's YAML -> WebConfig; WebConfigError names the offending field.
    Relative file names are the config's directory's (`base`), as in exporter-toolkit."""
    try:
        loaded = yaml.load(text, StrictLoader)
    except yaml.YAMLError as err:
        raise WebConfigError(f"not valid YAML: {str(err).splitlines()[0]}") from None
    top = fields(loaded, "", TOP_LEVEL)
    if "rate_limit" in top:
        raise WebConfigError("rate_limit is not supported by shmwatch")
    tls = parse_tls(fields(top.get(TLS), TLS, TLS_FIELDS), base)
    headers = parse_headers(fields(top.get(HTTP), HTTP, HTTP_FIELDS).get("headers"))
    return WebConfig(tls=tls, users=parse_users(top.get(USERS)), headers=headers)


def parse_tls(given: Dict[str, Any], base: str) -> Optional[TlsSettings]:
    unsupported = ", ".join(sorted(set(given) & TLS_UNSUPPORTED))
    if unsupported:
        use = f"use {', '.join(TLS_KEYS)}"
        raise WebConfigError(f"{TLS}: {unsupported} not supported by shmwatch ({use})")
    if not given:
        return None
    # Absent, null or empty fields: TlsSettings' defaults.
    settings: Dict[str, Any] = {k: given.get(k) for k in TLS_KEYS}
    settings = {k: v or getattr(TlsSettings, k, None) for k, v in settings.items()}
    if not settings["cert_file"] or not settings["key_file"]:
        raise WebConfigError(f"{TLS}: needs both cert_file and key_file")
    check_tls_choices(settings)
    for key in ("cert_file", "key_file", "client_ca_file"):
        settings[key] = settings[key] and os.path.join(base, settings[key])
    return TlsSettings(**settings)


def check_tls_choices(settings: Dict[str, Any]) -> None:
    auth, ca = settings["client_auth_type"], settings["client_ca_file"]
    if auth in UNVERIFIED_CLIENT_AUTH:
        raise WebConfigError(
            f"{TLS}: client_auth_type {auth} (a client certificate accepted without "
            "verification) is not supported: use RequireAndVerifyClientCert"
        )
    for key, choices in TLS_CHOICES.items():
        if settings[key] not in choices:
            value, names = shown(settings[key]), ", ".join(choices)
            raise WebConfigError(f"{TLS}: invalid {key} {value!r} (one of {names})")
    if auth != "NoClientCert" and not ca:
        raise WebConfigError(f"{TLS}: client_auth_type {auth} needs client_ca_file")
    if ca and auth == "NoClientCert":
        raise WebConfigError(
            f"{TLS}: client_ca_file is set but client_auth_type is NoClientCert "
            "(set client_auth_type: RequireAndVerifyClientCert)"
        )
    lowest, highest = settings["min_version"], settings["max_version"]
    if TLS_VERSIONS[lowest] > TLS_VERSIONS[highest]:
        raise WebConfigError(f"{TLS}: min_version is above max_version")


def parse_users(section: object) -> Dict[str, bytes]:
    users = {}
    for user, hashed in (typed(section, dict, USERS) or {}).items():
        if not isinstance(user, str):  # `yes:` is true and `1:` a number to YAML
            raise WebConfigError(f"{USERS}: the user name {user!r} must be quoted")
        where = f"{USERS}: the password of {user!r}"
        hashed = typed(hashed, str, where) or ""
        if not BCRYPT_HASH.fullmatch(hashed):
            raise WebConfigError(
                f"{where} is not a bcrypt hash bcrypt can check (make one with: "
                "htpasswd -nBC 10 \"\" | tr -d ':\\n')"
            )
        if int(hashed[4:6]) > MAX_BCRYPT_COST:  # each login would cost too much
            raise WebConfigError(
                f"{where} has bcrypt cost {hashed[4:6]}, above {MAX_BCRYPT_COST}, the most "
                "shmwatch takes (htpasswd -C 10 is the default)"
            )
        users[user] = hashed.encode()
    return users


def parse_headers(section: object) -> Tuple[Tuple[str, str], ...]:
    headers = []
    for name, value in (typed(section, dict, HEADERS_KEY) or {}).items():
        if name not in HEADERS:
            names = ", ".join(HEADERS)
            raise WebConfigError(f"{HEADERS_KEY}: {shown(name)} is not one of {names}")
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)  # `X-XSS-Protection: 0`, a string to Go's yaml
        allowed, value = HEADERS[name], typed(value, str, f"{HEADERS_KEY}.{name}") or ""
        if allowed and value and value.lower() not in allowed:
            names = ", ".join(allowed)
            raise WebConfigError(f"{HEADERS_KEY}: {name} must be one of {names}")
        if value:
            check_field_value(name, value)
            headers.append((name, value))
    return tuple(headers)


def check_field_value(name: str, value: str) -> None:
    """WebConfigError unless `value` can be written as header `name`'s value."""
    if FIELD_VALUE.fullmatch(value):
        return
    at = first_refused(value)
    raise WebConfigError(
        f"{HEADERS_KEY}.{name}: {ascii(value[at])} at character {at + 1} is not allowed "
        "in a header value (visible ASCII, with spaces or tabs only between words)"
    )


def first_refused(value: str) -> int:
    """Where a value FIELD_VALUE refuses goes wrong: its first character that is neither
    visible ASCII nor a space or tab, else the space or tab it starts or ends with."""
    for at, character in enumerate(value):
        if not ("\x21" <= character <= "\x7e" or character in " \t"):
            return at
    return 0 if value[0] in " \t" else len(value) - 1
