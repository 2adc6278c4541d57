"""--web.config.file (exporter-toolkit's format): basic auth with bcrypt hashes made here, TLS
and client certificates from the file, response headers, a certificate replaced on disk
served without a restart, and one clear error line for a bad file."""
import base64
import os
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request

import bcrypt
import pytest
from cryptography import x509

from exporter.exposition import webconfig
from tests.conftest import REPO, Exporter, needs_root
from tests.test_security import make_cert, write_pem


def basic(user, password):
    return {"Authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def status(url, headers=None, context=None):
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=5,
                                    context=context) as response:
            return response.status, dict(response.headers)
    except urllib.error.HTTPError as err:
        return err.code, dict(err.headers)


@pytest.fixture(scope="module")
def users():
    # A cheap cost for the test's speed, and the $2y$ spelling htpasswd writes for one of them.
    alice = bcrypt.hashpw(b"wonderland", bcrypt.gensalt(4)).decode()
    bob = bcrypt.hashpw(b"builder", bcrypt.gensalt(5)).decode().replace("$2b$", "$2y$", 1)
    return {"alice": alice, "bob": bob}


@needs_root
def test_basic_auth_and_headers(tmpfs, tmp_path, users):
    config = tmp_path / "web.yml"
    config.write_text("basic_auth_users:\n" + "".join(f"  {u}: '{h}'\n" for u, h in users.items())
                      + "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
                        "    X-Content-Type-Options: nosniff\n")
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}",
                  headers=basic("alice", "wonderland")) as exporter:
        code, headers = status(exporter.url)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert headers["X-Frame-Options"] == "deny"  # on refusals too
        assert status(exporter.url, basic("alice", "builder"))[0] == 401
        assert status(exporter.url, basic("mallory", "wonderland"))[0] == 401
        # An unknown user is checked against a dummy hash of "no such user": still refused.
        assert status(exporter.url, basic("mallory", "no such user"))[0] == 401
        assert status(exporter.url, {"Authorization": "Basic !!notbase64"})[0] == 401
        code, headers = status(exporter.url, basic("alice", "wonderland"))
        assert code == 200 and headers["X-Content-Type-Options"] == "nosniff"
        assert status(exporter.url, basic("bob", "builder"))[0] == 200
        assert "shmwatch_build_info" in exporter.scrape_text()
        # The readiness probe's path answers without credentials; the landing page does not.
        assert status(exporter.url.replace("/metrics", "/-/healthy"))[0] == 200
        assert status(exporter.url.replace("/metrics", "/"))[0] == 401

        # Users changed in the file take effect without a restart.
        carol = bcrypt.hashpw(b"lewis", bcrypt.gensalt(4)).decode()
        config.write_text(f"basic_auth_users:\n  carol: '{carol}'\n")
        os.utime(config, (time.time() + 5, time.time() + 5))  # a distinct mtime even within one tick
        assert status(exporter.url, basic("carol", "lewis"))[0] == 200
        assert status(exporter.url, basic("alice", "wonderland"))[0] == 401
        assert exporter.proc.poll() is None


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("webpki"))
    ca, ca_key = make_cert("shmwatch web CA", is_ca=True)
    first, first_key = make_cert("127.0.0.1", ca.subject, ca_key, san_ip="127.0.0.1")
    second, second_key = make_cert("127.0.0.1", ca.subject, ca_key, san_ip="127.0.0.1")
    client, client_key = make_cert("prometheus", ca.subject, ca_key)
    return {"dir": d, "ca": write_pem(d, "ca", ca, ca_key)[0], "first": write_pem(d, "first", first, first_key),
            "second": write_pem(d, "second", second, second_key), "client": write_pem(d, "client", client, client_key),
            "serials": (first.serial_number, second.serial_number)}


def served_serial(port, context):
    import socket
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        with context.wrap_socket(raw, server_hostname="127.0.0.1") as tls:
            return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number


@needs_root
def test_tls_from_web_config_and_certificate_rotation(tmpfs, tmp_path, pki, users):
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")
    for src, dst in zip(pki["first"], (cert, key)):
        with open(src, "rb") as f, open(dst, "wb") as g:
            g.write(f.read())
    config = tmp_path / "web.yml"
    # Relative names resolve against the config's directory, as in exporter-toolkit.
    config.write_text(f"tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n  min_version: TLS12\n"
                      f"basic_auth_users:\n  alice: '{users['alice']}'\n")
    context = ssl.create_default_context(cafile=pki["ca"])
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}", scheme="https",
                  context=context, headers=basic("alice", "wonderland")) as exporter:
        assert "shmwatch_build_info" in exporter.scrape_text()
        assert status(exporter.url, context=context)[0] == 401  # TLS and basic auth together
        with pytest.raises(OSError):  # plain HTTP is refused
            urllib.request.urlopen(exporter.url.replace("https", "http"), timeout=5).read()
        assert served_serial(exporter.port, context) == pki["serials"][0]
        pid = exporter.proc.pid

        # cert-manager style rotation: new key and certificate written in place.
        for src, dst in zip(pki["second"], (cert, key)):
            with open(src, "rb") as f, open(dst + ".tmp", "wb") as g:
                g.write(f.read())
            os.replace(dst + ".tmp", dst)
        assert served_serial(exporter.port, context) == pki["serials"][1]
        assert "shmwatch_build_info" in exporter.scrape_text()
        assert exporter.proc.pid == pid and exporter.proc.poll() is None

        # A half-written rotation (a key that does not match the certificate) keeps serving
        # the last good pair.
        with open(pki["first"][1], "rb") as f, open(key, "wb") as g:
            g.write(f.read())
        assert served_serial(exporter.port, context) == pki["serials"][1]
        assert "not reloaded" in exporter.log()


@needs_root
def test_client_certificates_from_web_config(tmpfs, tmp_path, pki):
    cert, key = pki["first"]
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
                      f"  client_ca_file: {pki['ca']}\n  client_auth_type: RequireAndVerifyClientCert\n")
    with_client = ssl.create_default_context(cafile=pki["ca"])
    with_client.load_cert_chain(*pki["client"])
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}", scheme="https",
                  context=with_client) as exporter:
        assert "shmwatch_build_info" in exporter.scrape_text()
        with pytest.raises(OSError):
            urllib.request.urlopen(exporter.url, timeout=5, context=ssl.create_default_context(cafile=pki["ca"]))
        assert "shmwatch_build_info" in exporter.scrape_text()


BAD = [
    ("tls_server_config: [", "not valid YAML"),
    ("basic_auth_users:\n  alice: plaintext\n", "not a bcrypt hash"),
    ("tls_server_config:\n  cert_file: /nonexistent.crt\n", "needs both cert_file and key_file"),
    ("tls_server_config:\n  cert_file: /nonexistent.crt\n  key_file: /nonexistent.key\n", "cannot load"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: RequireAnyClientCert\n",
     "not supported"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: Sometimes\n", "invalid client_auth_type"),
    ("tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: TLS99\n", "invalid min_version"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: always\n", "X-Frame-Options must be"),
    ("http_server_config:\n  headers:\n    Server: shmwatch\n", "Server is not one of"),
    ("basic_auth: {}\n", "unknown field basic_auth"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_a_bad_web_config_is_one_line_naming_the_flag(tmp_path, text, message):
    config = tmp_path / "web.yml"
    config.write_text(text)
    result = subprocess.run([sys.executable, "-m", "exporter", f"--web.config.file={config}",
                             "--web.listen-address=127.0.0.1:0", "--no-collector.gpu"],
                            cwd=REPO, capture_output=True, text=True, timeout=30)
    err = result.stderr.strip()
    assert result.returncode == 2, err
    assert len(err.splitlines()) == 1 and "--web.config.file" in err and message in err, err


def test_web_config_and_old_tls_flags_are_exclusive(tmp_path):
    (tmp_path / "web.yml").write_text("{}\n")
    result = subprocess.run([sys.executable, "-m", "exporter", f"--web.config.file={tmp_path / 'web.yml'}",
                             "--web.tls-cert-file=/c", "--web.tls-key-file=/k"], cwd=REPO, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 2 and "--web.config.file" in result.stderr and "--web.tls-" in result.stderr


def test_parse_resolves_relative_paths_and_defaults(tmp_path):
    config = webconfig.parse("tls_server_config:\n  cert_file: c.pem\n  key_file: /abs/k.pem\n", str(tmp_path))
    assert config.tls.cert_file == str(tmp_path / "c.pem") and config.tls.key_file == "/abs/k.pem"
    assert config.tls.client_auth_type == "NoClientCert" and config.tls.min_version == "TLS12"
    assert webconfig.parse("") == webconfig.WebConfig()  # an empty file: plain HTTP, no auth


def test_authorization_is_cached_and_bounded(users):
    source = webconfig.WebConfigSource(fixed=webconfig.WebConfig(users={"alice": users["alice"].encode()}))
    good = basic("alice", "wonderland")["Authorization"]
    assert source.authorized(source.config, good)
    started = time.perf_counter()
    for _ in range(200):
        assert source.authorized(source.config, good)
    assert time.perf_counter() - started < 0.5, "bcrypt ran on every request"
    for i in range(1100):  # a guessing client
        source._auth_cache[bytes([i % 256, i // 256])] = False
    assert not source.authorized(source.config, basic("alice", "guess")["Authorization"])
    assert len(source._auth_cache) <= 1025
