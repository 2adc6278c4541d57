"""exporter/exposition/webconfig.py: what connections take is read off their path (a watcher
thread, SIGHUP), kept when a reload fails, and a login costs its own user's bcrypt hash."""
import base64
import os
import shutil
import threading
import time

import bcrypt
import pytest

from exporter.exposition import webconfig
from exporter.exposition.webconfig import DUMMY_HASH, WebConfig, WebConfigSource


def basic(user, password):
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()


def verdict(source, header, peer="10.0.0.1"):
    answer = source.authorize(source.current()[0], header, peer)
    return answer if answer in (True, False, None) else answer.result(timeout=30)


@pytest.fixture(scope="module")
def hashes():
    """Real hashes at cost 10 and 14 (made once: the one at 14 of "14" takes seconds)."""
    fourteen = b"$2b$14$BdKerVCwTl9MMU/U2.HN7ufVPjU3XnRbbkztAs2due53QXIbp1koG"
    return {"ten": bcrypt.hashpw(b"ten", bcrypt.gensalt(10)), "fourteen": fourteen}


def test_a_login_costs_its_own_users_hash_only(hashes):
    """The old check padded every login to the costliest hash in the file (a cost-10 user
    paid for a neighbour's 14); exporter-toolkit checks the user's own hash, and an unknown
    user's against one fixed hash of cost 10."""
    checked = []

    def checkpw(password, hashed):
        checked.append(hashed)
        return bcrypt.checkpw(password, hashed) if hashed != hashes["fourteen"] else False

    source = WebConfigSource(fixed=WebConfig(users=dict(hashes)), checkpw=checkpw)
    assert verdict(source, basic("ten", "ten")) is True
    assert checked == [hashes["ten"]]
    assert verdict(source, basic("nobody", "no such user")) is False  # the dummy's password: still refused
    assert checked[1:] == [DUMMY_HASH] and DUMMY_HASH.startswith(b"$2b$10$")
    assert bcrypt.checkpw(b"no such user", DUMMY_HASH)  # what the comment on DUMMY_HASH says


def test_a_cost_10_login_takes_a_cost_10_time_beside_a_cost_14_user(hashes):
    """Timed with real bcrypt: padded, a cost-10 login took as long as one check at 14
    (2^14 rounds); now it takes 1/16 of that. Loose: under a quarter, the fastest of three."""
    source = WebConfigSource(fixed=WebConfig(users=dict(hashes)))
    started = time.perf_counter()
    bcrypt.checkpw(b"wrong", hashes["fourteen"])
    at_14 = time.perf_counter() - started
    logins = []
    for i in range(3):  # a new wrong password each time: nothing remembered
        started = time.perf_counter()
        assert verdict(source, basic("ten", f"wrong{i}")) is False
        logins.append(time.perf_counter() - started)
    print(f"\ncost-10 login {min(logins) * 1000:.0f} ms beside a cost-14 user; one check at 14: {at_14 * 1000:.0f} ms")
    assert min(logins) < at_14 / 4


def test_bcrypt_and_the_watcher_never_hold_up_exit(tmp_path, hashes):
    """Their threads are daemons: the old pool's were joined at exit, so a check at cost 31
    kept the process after SIGTERM (SIGKILL needed)."""
    path = tmp_path / "web.yml"
    path.write_text(f"basic_auth_users:\n  ten: '{hashes['ten'].decode()}'\n")
    ran_on = []

    def checkpw(password, hashed):
        ran_on.append(threading.current_thread())
        return False

    source = WebConfigSource(str(path), checkpw=checkpw)
    source.start()
    try:
        assert verdict(source, basic("ten", "wrong")) is False
        [watcher] = [t for t in threading.enumerate() if t.name == "shmwatch-webconfig"]
        assert watcher.daemon and [(t.name, t.daemon) for t in ran_on] == [("shmwatch-bcrypt", True)]
    finally:
        source.stop()
    watcher.join(2)
    assert not watcher.is_alive(), "stop() did not end the watcher"


def test_a_check_that_raises_fails_its_request_only(hashes):
    """bcrypt raising (a hash it cannot read) is that request's error (500), not a verdict."""

    def checkpw(password, hashed):
        raise ValueError("Invalid salt")

    source = WebConfigSource(fixed=WebConfig(users={"ten": hashes["ten"]}), checkpw=checkpw)
    pending = source.authorize(source.current()[0], basic("ten", "ten"), "10.0.0.1")
    with pytest.raises(ValueError, match="Invalid salt"):
        pending.result(timeout=10)


def replace(path, make):
    """`make(tmp)` builds the new file beside `path`; then it takes `path`'s place at once."""
    tmp = f"{path}.new"
    make(tmp)
    os.replace(tmp, path)


def looks(source, seconds=2.0):
    """One look of the watcher, on a thread of its own given `seconds`."""
    thread = threading.Thread(target=source.poll, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), "a look at the files blocked"


@pytest.mark.parametrize("target", ["config", "cert", "key"])
def test_a_fifo_swapped_in_keeps_the_last_good(tmp_path, target):
    """The old code opened the FIFO on the next connection and blocked there for good, with
    the lock every connection takes: no request, not even /-/healthy, was answered again."""
    from tests.system.test_security import make_cert, write_pem
    cert, key = write_pem(str(tmp_path), "tls", *make_cert("127.0.0.1", san_ip="127.0.0.1"))
    config = tmp_path / "web.yml"
    config.write_text(f"tls_server_config:\n  cert_file: {cert}\n  key_file: {key}\n")
    source = WebConfigSource(str(config))
    good, context = source.current()
    path = {"config": str(config), "cert": cert, "key": key}[target]
    shutil.copy(path, tmp_path / "saved")
    replace(path, os.mkfifo)
    looks(source)
    assert source.current() == (good, context) and source.reload_ok is False
    replace(path, lambda tmp: shutil.copy(tmp_path / "saved", tmp))  # a good file again
    looks(source)
    assert source.reload_ok is True and source.current()[1] is not context


def test_a_connection_reads_no_file(tmp_path, hashes):
    """current() and authorize() hand out what the watcher installed: a file changed (here
    to one that is refused) is not even looked at until the watcher's next look."""
    config = tmp_path / "web.yml"
    config.write_text(f"basic_auth_users:\n  ten: '{hashes['ten'].decode()}'\n")
    source = WebConfigSource(str(config), checkpw=lambda password, hashed: True)
    replace(str(config), os.mkfifo)
    for _ in range(3):
        assert list(source.current()[0].users) == ["ten"]
        assert verdict(source, basic("ten", "any")) is True
    assert source.reload_ok and source.generation == 0
    looks(source)
    assert not source.reload_ok and source.generation == 1


def test_reload_reads_on_the_watchers_thread(tmp_path):
    """SIGHUP's reload() read the files in the signal handler, on the main thread (a FIFO
    blocked it, and SIGTERM's handler with it); now it only wakes the watcher."""

    class Watched(WebConfigSource):
        def poll(self, force=False):
            looked.append((threading.current_thread().name, force))
            super().poll(force)

    looked = []
    config = tmp_path / "web.yml"
    config.write_text("{}\n")
    source = Watched(str(config), interval=3600)  # no look but the one asked for
    source.start()
    try:
        replace(str(config), os.mkfifo)
        source.reload()
        deadline = time.monotonic() + 5
        while source.reload_ok:
            assert time.monotonic() < deadline, "the watcher did not reload"
            time.sleep(0.01)
    finally:
        source.stop()
        source.reload()  # wakes it to end now, not in an hour
    assert looked[0] == ("shmwatch-webconfig", True), looked


def test_a_cost_31_hash_at_reload_is_refused_and_costs_nothing(tmp_path, hashes):
    """It was taken (its dummy hash made at once: a core busy for days, no client at all,
    and every other login timed out); now the last good serves and no bcrypt runs."""
    config = tmp_path / "web.yml"
    good = f"basic_auth_users:\n  ten: '{hashes['ten'].decode()}'\n"
    config.write_text(good)
    source = WebConfigSource(str(config))
    costly = "$2b$31$" + hashes["ten"].decode()[7:]
    replace(str(config), lambda tmp: open(tmp, "w").write(good + f"  mallory: '{costly}'\n"))
    generation = source.generation
    looks(source)
    assert source.reload_ok is False and source.generation != generation
    assert list(source.current()[0].users) == ["ten"]
    cpu = sum(os.times()[:2])
    time.sleep(0.5)
    assert sum(os.times()[:2]) - cpu < 0.2, "something hashes with no login asked for"
    assert verdict(source, basic("ten", "ten")) is True


def test_the_watcher_keeps_a_stamp_per_file(tmp_path):
    """What a look compares: every file's (path, mtime, size, inode), a missing one as -1s."""
    (tmp_path / "a").write_text("x")
    stamp = webconfig.stamp_of(str(tmp_path / "a"), None, str(tmp_path / "gone"))
    st = os.stat(tmp_path / "a")
    assert stamp == ((str(tmp_path / "a"), st.st_mtime_ns, 1, st.st_ino), (str(tmp_path / "gone"), -1, -1, -1))


def test_a_bcrypt_thread_that_cannot_start_is_busy_once_not_for_good(hashes, monkeypatch):
    """Thread.start() raising (RuntimeError: can't start new thread, at a pids limit) left the
    address in the set of those being checked, with no check to take it out: every later
    login from it was "busy" (503) for good, and the first one raised out of authorize()."""
    source = WebConfigSource(fixed=WebConfig(users={"ten": hashes["ten"]}))
    start = threading.Thread.start

    def no_bcrypt_thread(thread):
        if thread.name == "shmwatch-bcrypt":
            raise RuntimeError("can't start new thread")
        start(thread)

    monkeypatch.setattr(threading.Thread, "start", no_bcrypt_thread)
    assert verdict(source, basic("ten", "ten")) is None  # busy: 503 and Retry-After
    monkeypatch.setattr(threading.Thread, "start", start)
    assert verdict(source, basic("ten", "ten")) is True  # the same address, checked


def test_the_front_answers_503_once_when_no_bcrypt_thread_starts(hashes, monkeypatch):
    """Through the front: the login whose check could not start gets 503 and Retry-After
    (the old code raised out of authorize(), and the connection was dropped unanswered);
    the next login from the same address is checked and served."""
    from tests.unit.exposition.test_http import Server, basic as basic_line, status

    source = WebConfigSource(fixed=WebConfig(users={"ten": hashes["ten"]}))
    server, start = Server(web=source), threading.Thread.start
    request = b"GET /metrics HTTP/1.1\r\nHost: x\r\n" + basic_line("ten", "ten") + b"Connection: close\r\n\r\n"

    def no_bcrypt_thread(thread):
        if thread.name == "shmwatch-bcrypt":
            raise RuntimeError("can't start new thread")
        start(thread)

    try:
        monkeypatch.setattr(threading.Thread, "start", no_bcrypt_thread)
        busy = server.ask(request)
        assert status(busy) == b"HTTP/1.1 503 Service Unavailable" and b"Retry-After: 1\r\n" in busy, busy
        monkeypatch.setattr(threading.Thread, "start", start)
        assert status(server.ask(request)) == b"HTTP/1.1 200 OK"
    finally:
        server.front.shutdown()
