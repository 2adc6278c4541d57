"""Live: shmwatch -> Prometheus (the shipped rules) -> Alertmanager (the example routing) -> webhook.

A 16 MiB tmpfs filled to 85 % pages chat with a warning, to 97 % pages the pager with a
critical, and freeing it sends the resolved notification. ShmUsageCritical keeps its real
`for:` (the others are cut to 1 s): the page must not come before it.
"""
import os
import time

import yaml

from tests.conftest import REPO, Exporter, mounted_tmpfs, needs_root
from tests.live import RULES, Alertmanager, Prometheus, Webhook, fast_rules

MiB = 1 << 20


def test_alertmanager_example_config_is_valid():
    import shutil
    import subprocess
    amtool = shutil.which("amtool")
    assert amtool, "amtool not installed (Debian 'prometheus-alertmanager')"
    result = subprocess.run([amtool, "check-config", os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def am_config_with_webhook(port):
    """The example routing tree and inhibition, with its receivers pointed at the test's webhook."""
    with open(os.path.join(REPO, "deploy", "alertmanager", "alertmanager.yml")) as f:
        config = yaml.safe_load(f)
    config["receivers"] = [{"name": r["name"], "webhook_configs": [
        {"url": f"http://127.0.0.1:{port}/{r['name']}", "send_resolved": True}]} for r in config["receivers"]]
    config["route"].update(group_wait="1s", group_interval="1s")
    return config


def fill(path, mib):
    with open(path, "wb") as f:
        for _ in range(int(mib)):
            f.write(b"\1" * MiB)
        rest = int((mib - int(mib)) * MiB)
        f.write(b"\1" * rest)


def firing(name):
    return lambda body: body["status"] == "firing" and any(
        a["labels"]["alertname"] == name and a["status"] == "firing" for a in body["alerts"])


def resolved(name):
    return lambda body: any(a["labels"]["alertname"] == name and a["status"] == "resolved" for a in body["alerts"])


@needs_root
def test_shm_exhaustion_pages_end_to_end(tmp_path):
    rules = str(tmp_path / "rules.yml")
    with open(RULES) as f:
        real_for = next(r["for"] for g in yaml.safe_load(f)["groups"] for r in g["rules"]
                        if r.get("alert") == "ShmUsageCritical")
    real_for_s = {"s": 1, "m": 60}[real_for[-1]] * int(real_for[:-1])
    # Long enough to mean something, short enough for the suite.
    assert 30 <= real_for_s <= 120, f"ShmUsageCritical for: {real_for}: pick another alert for this test"
    fast_rules(rules, keep=("ShmUsageCritical",))
    with mounted_tmpfs("16m") as shm, Webhook() as hook, \
            Exporter(f"--shm.mount={shm}", "--no-collector.gpu", "--poll-interval=200ms",
                     "--peak-window=5s") as exporter, \
            Alertmanager(str(tmp_path), am_config_with_webhook(hook.port)) as am, \
            Prometheus(str(tmp_path), [f"127.0.0.1:{exporter.port}"], rules=rules, alertmanager=am.address) as prom:
        assert prom.wait_query('up{job="shmwatch"} == 1'), "Prometheus does not scrape shmwatch"
        data = os.path.join(shm, "psm_filler")
        fill(data, 13.75)  # 86 %
        body = hook.wait("/chat", firing("ShmUsageHigh"))
        alert = next(a for a in body["alerts"] if a["labels"]["alertname"] == "ShmUsageHigh")
        assert alert["labels"]["severity"] == "warning" and alert["labels"]["mount"] == shm
        assert "85.94% full" in alert["annotations"]["summary"], alert["annotations"]
        assert alert["annotations"]["runbook_url"].endswith("runbook.md#shmusagehigh")
        assert "--shm-size" in alert["annotations"]["description"]

        fill(data, 15.5)  # 97 %
        filled = time.monotonic()
        body = hook.wait("/pager", firing("ShmUsageCritical"), timeout=real_for_s + 60)
        assert time.monotonic() - filled >= real_for_s, f"paged before its for: {real_for}"
        alert = next(a for a in body["alerts"] if a["labels"]["alertname"] == "ShmUsageCritical")
        assert alert["labels"]["severity"] == "critical" and "96.88% full" in alert["annotations"]["summary"]
        assert "NCCL_SHM_DISABLE=1 only as a last resort" in alert["annotations"]["description"]

        os.unlink(data)
        hook.wait("/pager", resolved("ShmUsageCritical"))
        # No critical ever went to chat, no warning to the pager.
        assert not [b for b in hook.received.get("/chat", []) if b["commonLabels"].get("severity") == "critical"]
        assert not [b for b in hook.received.get("/pager", []) if b["commonLabels"].get("severity") == "warning"]
