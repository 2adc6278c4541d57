"""Real Prometheus and Alertmanager (Debian packages) for live tests, on 127.0.0.1 only."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional

import pytest
import yaml

from tests.conftest import REPO, free_port, stop_process

RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-rules.yml")
RECOMMEND_RULES = os.path.join(REPO, "deploy", "prometheus", "shmwatch-recommend-rules.yml")


def binary(*names: str) -> str:
    for name in names:
        path = shutil.which(name)
        if path:
            return path
    pytest.fail(f"none of {names} is installed (.ci/run installs them from Debian)")


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def fast_rules(path: str, for_duration: str = "1s", keep: tuple = ()) -> None:
    """The shipped rules (alerts and the shm size recommendation) with short `for:` so a live
    test does not wait minutes; the alerts named in `keep` keep their real `for:`, so at least
    one is tested as shipped."""
    rules = {"groups": []}
    for source in (RULES, RECOMMEND_RULES):
        with open(source) as f:
            rules["groups"] += yaml.safe_load(f)["groups"]
    for group in rules["groups"]:
        group["interval"] = "1s"
        for rule in group["rules"]:
            if "for" in rule and rule.get("alert") not in keep:
                rule["for"] = for_duration
    with open(path, "w") as f:
        yaml.safe_dump(rules, f)


class _Service:
    """A server process with a log file, ready when `ready_url` answers; stopped on exit."""
    args: List[str]
    log: Any = None  # the subclass's open log file
    ready_url = ""

    def __enter__(self):
        self.proc = subprocess.Popen(self.args, stdout=self.log, stderr=self.log)
        wait_http(self.ready_url)
        return self

    def __exit__(self, *exc) -> None:
        stop_process(self.proc, 10)
        self.log.close()


class Prometheus(_Service):
    def __init__(self, workdir: str, targets: List[str], rules: Optional[str] = None,
                 alertmanager: Optional[str] = None, honor_labels: bool = False):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s", "scrape_timeout": "900ms"},
            "scrape_configs": [{"job_name": "shmwatch", "static_configs": [{"targets": targets}]}],
        }
        if honor_labels:  # targets that name their own job and instance (several exporters' series in one)
            config["scrape_configs"][0]["honor_labels"] = True
        if rules:
            config["rule_files"] = [rules]
        if alertmanager:
            config["alerting"] = {"alertmanagers": [{"static_configs": [{"targets": [alertmanager]}]}]}
        self.config = os.path.join(workdir, "prometheus.yml")
        with open(self.config, "w") as f:
            yaml.safe_dump(config, f)
        self.args = [binary("prometheus"), f"--config.file={self.config}",
                     f"--storage.tsdb.path={os.path.join(workdir, 'tsdb')}",
                     f"--web.listen-address=127.0.0.1:{self.port}", "--rules.alert.resend-delay=1s",
                     "--log.level=warn"]
        self.log = open(os.path.join(workdir, "prometheus.log"), "wb")
        self.ready_url = self.url + "/-/ready"

    def query(self, expr: str) -> List[Dict]:
        url = f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
        with urllib.request.urlopen(url, timeout=10) as response:
            body = json.load(response)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def wait_query(self, expr: str, timeout: float = 30.0) -> List[Dict]:
        """The first non-empty result of `expr`; an AssertionError when none came in time."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            result = self.query(expr)
            if result:
                return result
            time.sleep(0.5)
        raise AssertionError(f"{expr!r}: no result from Prometheus in {timeout:.0f}s")


class Webhook:
    """Receives Alertmanager's webhook notifications: one list per path (receiver)."""

    def __init__(self):
        self.port = free_port()
        self.received: Dict[str, List[Dict]] = {}
        self.lock = threading.Lock()
        hook = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with hook.lock:
                    hook.received.setdefault(self.path, []).append(body)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)

    def __enter__(self) -> "Webhook":
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait(self, path: str, predicate, timeout: float = 60.0) -> Dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                for body in self.received.get(path, []):
                    if predicate(body):
                        return body
            time.sleep(0.2)
        with self.lock:
            seen = {p: [(b["status"], [a["labels"].get("alertname") for a in b["alerts"]]) for b in bodies]
                    for p, bodies in self.received.items()}
        raise AssertionError(f"no matching notification at {path} in {timeout}s; received: {seen}")


class Alertmanager(_Service):
    def __init__(self, workdir: str, config: Dict):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        path = os.path.join(workdir, "alertmanager.yml")
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        self.args = [binary("prometheus-alertmanager", "alertmanager"), f"--config.file={path}",
                     f"--storage.path={os.path.join(workdir, 'am')}", f"--web.listen-address={self.address}",
                     "--cluster.listen-address=", "--log.level=warn"]
        self.log = open(os.path.join(workdir, "alertmanager.log"), "wb")
        self.ready_url = f"http://{self.address}/-/ready"
