"""recommend.settings_for: the kubectl patch is a command to paste, its JSON one quoted
argument whatever the volume is named; the YAML line shows the name escaped."""
import json
import shlex

from exporter.check.recommend import settings_for
from tests.behaviour.hostile_names import pasted


def test_the_patch_is_one_argument_whatever_the_volume_name(tmp_path):
    volume = "dshm'$(touch PWNED)'\x1b"
    settings = settings_for(1 << 30, volume, None)
    argv = pasted(settings["kubectl_patch"].replace("<name>", "web").encode(), str(tmp_path))
    assert argv[:6] == [b"kubectl", b"patch", b"deployment", b"web", b"--type=strategic", b"-p"]
    patch = json.loads(argv[6])
    assert patch["spec"]["template"]["spec"]["volumes"][0] == {
        "name": volume, "emptyDir": {"medium": "Memory", "sizeLimit": "1Gi"}}
    assert "name: dshm'$(touch PWNED)'\\x1b," in settings["kubernetes_volume"]
    assert shlex.split(settings_for(1 << 30, "dshm", None)["kubectl_patch"])[-1].startswith('{"spec"')
