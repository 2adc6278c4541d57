#!/usr/bin/env python3
"""Write deploy/kubernetes/prometheusrule.yaml (Prometheus Operator) from shmwatch-rules.yml.

    python3 deploy/prometheus/make_prometheusrule.py
tests/test_rules.py fails when the two differ.
"""
import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "kubernetes", "rules", "prometheusrule.yaml")


class Dumper(yaml.SafeDumper):
    """Indented sequences and folded long strings: the output passes yamllint."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def _str(dumper, value):
    style = ">" if len(value) > 100 else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _str)


def main():
    with open(os.path.join(HERE, "shmwatch-rules.yml")) as f:
        rules = yaml.safe_load(f)
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": "shmwatch", "labels": {"app.kubernetes.io/name": "shmwatch", "release": "prometheus"}},
        "spec": rules,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("# Generated from deploy/prometheus/shmwatch-rules.yml by deploy/prometheus/make_prometheusrule.py;\n"
                "# edit the rules file, not this one.\n---\n")
        yaml.dump(manifest, f, Dumper=Dumper, sort_keys=False, width=110)


if __name__ == "__main__":
    main()
