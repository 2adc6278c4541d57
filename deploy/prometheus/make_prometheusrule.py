#!/usr/bin/env python3
"""Write deploy/kubernetes/prometheusrule.yaml (Prometheus Operator) from shmwatch-rules.yml.

    python3 deploy/prometheus/make_prometheusrule.py
tests/test_rules.py fails when the two differ.
"""
import os

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "kubernetes", "prometheusrule.yaml")


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
        yaml.safe_dump(manifest, f, sort_keys=False, width=120)


if __name__ == "__main__":
    main()
