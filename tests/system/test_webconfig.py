"""--web.config.file (exporter-toolkit's format): basic auth with bcrypt hashes made here, TLS
and client certificates from the file, response headers, a certificate replaced on disk
served without a restart, and one clear error line for a bad file."""
import base64
import os
import signal
import ssl
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import bcrypt
import pytest
from cryptography import x509

from exporter.exposition import webconfig
from tests.conftest import REPO, Exporter, needs_root, value
from tests.system.test_security import make_cert, write_pem


def eventually(predicate, timeout=10.0, what=""):
    """predicate()'s first true value within `timeout` s: the watcher looks every half second."""
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        assert time.monotonic() < deadline, f"not within {timeout} s: {what}"
        time.sleep(0.1)
    return result


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

        # Users changed in the file take effect without a restart (the watcher's next look).
        carol = bcrypt.hashpw(b"lewis", bcrypt.gensalt(4)).decode()
        config.write_text(f"basic_auth_users:\n  carol: '{carol}'\n")
        os.utime(config, (time.time() + 5, time.time() + 5))  # a distinct mtime even within one tick
        eventually(lambda: status(exporter.url, basic("carol", "lewis"))[0] == 200, what="carol let in")
        assert status(exporter.url, basic("alice", "wonderland"))[0] == 401
        assert exporter.proc.poll() is None


def rewrite(path, text, step=[0]):
    """Write `text` to `path` with an mtime of its own, as an edit seconds later would."""
    step[0] += 10
    path.write_text(text)
    os.utime(path, (time.time() + step[0], time.time() + step[0]))


RELOADED = "shmwatch_web_config_last_reload_successful"


@needs_root
def test_a_reload_that_would_turn_basic_auth_off_is_refused(tmpfs, tmp_path, users):
    """An emptied file, one cut after `basic_auth_users:`, or no users: the old code served
    /metrics to anyone; now the last good config serves, a warning says why, and the reload
    metric says 0 until a good file comes."""
    config = tmp_path / "web.yml"
    good = f"basic_auth_users:\n  alice: '{users['alice']}'\n"
    config.write_text(good)
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}",
                  headers=basic("alice", "wonderland")) as exporter:
        assert value(exporter.scrape(), RELOADED) == 1
        for text in ("", "basic_auth_users:\n", "basic_auth_users:", "basic_auth_users: {}\n",
                     "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"):
            rewrite(config, text)
            eventually(lambda: value(exporter.scrape(), RELOADED) == 0, what=text)
            assert status(exporter.url)[0] == 401, text
            rewrite(config, good)
            eventually(lambda: value(exporter.scrape(), RELOADED) == 1, what="the good file back")
            assert status(exporter.url)[0] == 401
        log = exporter.log()
        assert "level=warn" in log and "would turn off basic authentication" in log, log[-1500:]


@needs_root
def test_sighup_reloads_the_web_config(tmpfs, tmp_path, users):
    """As Prometheus components do; the old process ended at SIGHUP (exit 129). The change
    here keeps size, inode and mtime, so only the SIGHUP can find it."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  alice: '{users['alice']}'\n")
    carol = bcrypt.hashpw(b"lewis", bcrypt.gensalt(4)).decode()
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}",
                  headers=basic("alice", "wonderland")) as exporter:
        before = os.stat(config)
        with open(config, "r+") as f:
            f.write(f"basic_auth_users:\n  carol: '{carol}'\n")
        os.utime(config, ns=(before.st_atime_ns, before.st_mtime_ns))
        assert status(exporter.url, basic("carol", "lewis"))[0] == 401  # not seen yet
        exporter.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 10
        while status(exporter.url, basic("carol", "lewis"))[0] != 200:
            assert exporter.proc.poll() is None, f"exited {exporter.proc.returncode} at SIGHUP"
            assert time.monotonic() < deadline, exporter.log()[-1500:]
            time.sleep(0.1)
        assert "received SIGHUP" in exporter.log()
        assert status(exporter.url, basic("alice", "wonderland"))[0] == 401


@needs_root
def test_a_wrong_password_flood_does_not_starve_a_valid_login(tmpfs, tmp_path):
    """100 clients sending wrong passwords as fast as they are answered (one bcrypt check
    at a time for their address, 503 at once for the rest): a valid login never seen
    before, from another address, is answered 200 in time."""
    import http.client
    hashed = bcrypt.hashpw(b"scrape-me", bcrypt.gensalt(10)).decode()
    ready = bcrypt.hashpw(b"ready", bcrypt.gensalt(10)).decode()  # for the start-up checks only
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  prometheus: '{hashed}'\n  probe: '{ready}'\n")
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}",
                  headers=basic("probe", "ready")) as exporter:
        stop, refused = threading.Event(), []

        def flood(i):
            while not stop.is_set():  # a new guess each time: nothing to remember
                code = status(exporter.url, basic("prometheus", f"guess{i}-{len(refused)}"))[0]
                refused.append(code)

        flooders = [threading.Thread(target=flood, args=(i,), daemon=True) for i in range(100)]
        for thread in flooders:
            thread.start()
        try:
            time.sleep(1)  # the flood under way
            timings = []
            for password in ("scrape-me", "scrape-me"):  # new (bcrypt), then remembered
                conn = http.client.HTTPConnection("127.0.0.1", exporter.port, timeout=10,
                                                  source_address=("127.0.0.2", 0))
                started = time.monotonic()
                conn.request("GET", "/metrics", headers=basic("prometheus", password))
                response = conn.getresponse()
                timings.append(time.monotonic() - started)
                assert response.status == 200 and b"shmwatch_build_info" in response.read()
                conn.close()
        finally:
            stop.set()
            for thread in flooders:
                thread.join(30)
        print(f"\nvalid login under a flood of {len(refused)} wrong ones: {timings[0] * 1000:.0f} ms, "
              f"remembered {timings[1] * 1000:.0f} ms")
        assert timings[0] < 3 and timings[1] < 1, timings
        assert 401 in refused and set(refused) <= {401, 503}


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
        eventually(lambda: served_serial(exporter.port, context) == pki["serials"][1], what="rotated")
        assert "shmwatch_build_info" in exporter.scrape_text()
        assert exporter.proc.pid == pid and exporter.proc.poll() is None

        # A half-written rotation (a key that does not match the certificate) keeps serving
        # the last good pair.
        with open(pki["first"][1], "rb") as f, open(key, "wb") as g:
            g.write(f.read())
        eventually(lambda: "not reloaded" in exporter.log(), what="the mismatched key refused")
        assert served_serial(exporter.port, context) == pki["serials"][1]


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


@needs_root
def test_a_reload_that_would_drop_client_certificates_is_refused(tmpfs, tmp_path, pki):
    cert, key = pki["first"]
    config = tmp_path / "web.yml"
    tls = f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n"
    config.write_text(tls + f"  client_ca_file: {pki['ca']}\n  client_auth_type: RequireAndVerifyClientCert\n")
    with_client = ssl.create_default_context(cafile=pki["ca"])
    with_client.load_cert_chain(*pki["client"])
    without = ssl.create_default_context(cafile=pki["ca"])
    with Exporter(f"--shm.mount={tmpfs}", "--no-collector.gpu", f"--web.config.file={config}", scheme="https",
                  context=with_client) as exporter:
        for weaker in (tls, tls + f"  client_ca_file: {pki['ca']}\n  client_auth_type: VerifyClientCertIfGiven\n"):
            rewrite(config, weaker)
            eventually(lambda: value(exporter.scrape(), RELOADED) == 0, what=weaker)
            with pytest.raises(OSError):
                urllib.request.urlopen(exporter.url, timeout=5, context=without).read()
        assert "would turn off client certificate verification" in exporter.log()


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
    ("basic_auth_users:\n  alice: '$2b$99$" + "a" * 53 + "'\n", "not a bcrypt hash"),  # cost above 31
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


def verdict(source, header, peer=""):
    result = source.authorize(source.config, header, peer)
    return result if isinstance(result, bool) else result.result(timeout=30)


def test_successes_are_cached_and_failures_are_not(users):
    source = webconfig.WebConfigSource(fixed=webconfig.WebConfig(users={"alice": users["alice"].encode()}))
    good = basic("alice", "wonderland")["Authorization"]
    assert verdict(source, good)
    started = time.perf_counter()
    for _ in range(200):
        assert source.authorize(source.config, good) is True  # at once, no bcrypt
    assert time.perf_counter() - started < 0.5, "bcrypt ran on every request"
    for i in range(3):
        assert not verdict(source, basic("alice", f"guess{i}")["Authorization"])
    assert len(source._good) == 1


def test_a_password_over_72_bytes_works_as_htpasswd_made_it():
    """htpasswd and Go's bcrypt read the first 72 bytes; bcrypt 5 raises on more."""
    password = "p" * 72 + "-and-more-than-bcrypt-reads"
    hashed = bcrypt.hashpw(password.encode()[:72], bcrypt.gensalt(4))
    source = webconfig.WebConfigSource(fixed=webconfig.WebConfig(users={"long": hashed}))
    assert verdict(source, basic("long", password)["Authorization"])


def test_bcrypt_checks_are_bounded():
    """A few checks at once, one per client address, a short queue: busy (None) beyond it."""
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(10))
    source = webconfig.WebConfigSource(fixed=webconfig.WebConfig(users={"u": hashed}))
    wrong = basic("u", "wrong")["Authorization"]
    pending = [source.authorize(source.config, wrong, "10.0.0.1")]
    assert source.authorize(source.config, wrong, "10.0.0.1") is None  # one per address
    pending += [source.authorize(source.config, wrong, f"10.0.0.{i}") for i in range(2, 2 + webconfig.BCRYPT_QUEUE)]
    assert pending[-1] is None  # the queue is full
    assert not any(f.result(timeout=60) for f in pending[:-1])
    assert verdict(source, basic("u", "right")["Authorization"], "10.0.0.1")


def test_a_valid_password_while_bcrypt_is_busy_gets_503_not_401():
    """A check from the same address under way (two Prometheus replicas behind one NAT, just
    after a start or reload): the valid login is told to retry (503, Retry-After), not that
    its password is wrong; a wrong one still gets 401."""
    from exporter.exposition import http
    hashed = bcrypt.hashpw(b"right", bcrypt.gensalt(13))
    source = webconfig.WebConfigSource(fixed=webconfig.WebConfig(users={"u": hashed}))

    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok\n"]

    httpd = http.bind("127.0.0.1", 0, app, source)
    httpd.start()
    url = "http://127.0.0.1:%d/metrics" % httpd.server_address[1]
    try:
        pending = source.authorize(source.config, basic("u", "other")["Authorization"], "127.0.0.1")
        code, headers = status(url, basic("u", "right"))
        assert code == 503 and headers["Retry-After"] == "1", (code, headers)
        assert pending.result(timeout=60) is False
        assert status(url, basic("u", "right"))[0] == 200
        assert status(url, basic("u", "wrong"))[0] == 401
    finally:
        httpd.shutdown()


def test_the_reload_metric_is_1_again_when_the_good_file_is_back(tmp_path, users):
    """A refused change, then the last good file moved back in place (same inode and mtime,
    so nothing to reload): the old code kept reporting the failed reload."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  alice: '{users['alice']}'\n")
    source = webconfig.WebConfigSource(str(path))
    os.rename(path, tmp_path / "good.yml")
    rewrite(path, "basic_auth_users: {}\n")  # would turn basic auth off: refused
    source.poll()  # the watcher's look
    assert source.current()[0].users and source.reload_ok is False
    failed = source.generation  # /metrics is rendered again when it moves
    os.rename(tmp_path / "good.yml", path)
    source.poll()
    assert source.current()[0].users and source.reload_ok is True
    assert source.generation != failed, "a cached /metrics would keep saying 0"
    rewrite(path, "basic_auth_users: {}\n")  # the bad file again: refused again
    source.poll()
    assert source.current()[0].users and source.reload_ok is False


def test_a_certificate_rotated_while_start_up_loads_it_is_loaded_next(tmp_path, pki, monkeypatch):
    """Start-up stamps the files before loading them, as a reload does: a rotation that lands
    while the first pair loads is loaded for the next connection, not missed until the next."""
    cert, key = str(tmp_path / "tls.crt"), str(tmp_path / "tls.key")

    def install(pair):
        for src, dst in zip(pair, (cert, key)):
            with open(src, "rb") as f, open(dst + ".tmp", "wb") as g:
                g.write(f.read())
            os.replace(dst + ".tmp", dst)

    install(pki["first"])
    config = tmp_path / "web.yml"
    config.write_text("tls_server_config:\n  cert_file: tls.crt\n  key_file: tls.key\n")
    load, loaded = webconfig.TlsSettings.context, []

    def load_then_rotate(settings):
        context = load(settings)
        if not loaded:
            install(pki["second"])
        loaded.append(context)
        return context

    monkeypatch.setattr(webconfig.TlsSettings, "context", load_then_rotate)
    source = webconfig.WebConfigSource(str(config))
    source.poll()  # the watcher's first look
    assert source.current()[1] is not loaded[0] and len(loaded) == 2 and source.reload_ok
