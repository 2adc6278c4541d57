#!/usr/bin/env python3
"""Write the Prometheus Operator PrometheusRule manifests from the plain rule files:

    shmwatch-rules.yml      -> deploy/kubernetes/rules/prometheusrule.yaml
    shmwatch-node-rules.yml -> deploy/kubernetes/daemonset/node-recording-rules.yaml
    shmwatch-recommend-rules.yml -> deploy/kubernetes/rules/recommend-rules.yaml

    python3 deploy/prometheus/make_prometheusrule.py
tests/test_rules.py and tests/test_recommend.py fail when they differ.
"""
import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUTS = (("shmwatch-rules.yml", os.path.join(HERE, "..", "kubernetes", "rules", "prometheusrule.yaml"), "shmwatch"),
           ("shmwatch-node-rules.yml", os.path.join(HERE, "..", "kubernetes", "daemonset", "node-recording-rules.yaml"),
            "shmwatch-node"),
           ("shmwatch-recommend-rules.yml", os.path.join(HERE, "..", "kubernetes", "rules", "recommend-rules.yaml"),
            "shmwatch-recommend"))


class Dumper(yaml.SafeDumper):
    """Indented sequences and folded long strings: the output passes yamllint."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def _str(dumper, value):
    style = ">" if len(value) > 100 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _str)


def write(source, out, name):
    with open(os.path.join(HERE, source)) as f:
        rules = yaml.safe_load(f)
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "shmwatch", "release": "prometheus"}},
        "spec": rules,
    }
    with open(out, "w") as f:
        f.write(f"# Generated from deploy/prometheus/{source} by deploy/prometheus/make_prometheusrule.py;\n"
                "# edit the rules file, not this one.\n---\n")
        yaml.dump(manifest, f, Dumper=Dumper, sort_keys=False, width=110)


def main():
    for source, out, name in OUTPUTS:
        write(source, out, name)


if __name__ == "__main__":
    main()
