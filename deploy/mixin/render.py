#!/usr/bin/env python3
"""Render the mixin into the files the repository ships:

    deploy/prometheus/shmwatch-rules.yml                (alerts + the recording rules they use)
    deploy/prometheus/shmwatch-node-rules.yml           (node mode's pod-name joins)
    deploy/prometheus/shmwatch-recommend-rules.yml      (the shm size recommendation)
    deploy/kubernetes/rules/prometheusrule.yaml         (the first, as a PrometheusRule)
    deploy/kubernetes/daemonset/node-recording-rules.yaml  (the second, as a PrometheusRule)
    deploy/prometheus/shmwatch-kube-rules.yml           (kube-prometheus joins: cAdvisor, kube-state-metrics)
    deploy/kubernetes/rules/kube-recording-rules.yaml   (the third, as a PrometheusRule)
    grafana/shmwatch.json                               (the dashboard)

    python3 deploy/mixin/render.py [OUTPUT_ROOT]        # default: the repository

jsonnet evaluates (Debian's `jsonnet` CLI); Python only lays the result out as readable
YAML (rule keys in the order people write them, long strings folded). tests/project/test_mixin.py
renders into a temporary directory and fails when the committed files differ.
"""
import json
import os
import shutil
import subprocess
import sys

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HEADER = ("# Generated from deploy/mixin/ by deploy/mixin/render.py: edit the mixin, not this file.\n"
          "# Each alert and record has scenarios with exact values in tests/rules/ (mutation-tested by\n"
          "# bench/rule_mutation.py), and each alert a section in deploy/prometheus/runbook.md.\n")
# (plain rules file, PrometheusRule manifest, its metadata.name)
OPERATOR = (("deploy/prometheus/shmwatch-rules.yml", "deploy/kubernetes/rules/prometheusrule.yaml", "shmwatch"),
            ("deploy/prometheus/shmwatch-node-rules.yml", "deploy/kubernetes/daemonset/node-recording-rules.yaml",
             "shmwatch-node"),
            ("deploy/prometheus/shmwatch-recommend-rules.yml", "deploy/kubernetes/rules/recommend-rules.yaml",
             "shmwatch-recommend"),
            ("deploy/prometheus/shmwatch-kube-rules.yml", "deploy/kubernetes/rules/kube-recording-rules.yaml",
             "shmwatch-kube"))
RULE_KEYS = ("record", "alert", "expr", "for", "keep_firing_for", "labels", "annotations")
ANNOTATION_KEYS = ("summary", "description", "runbook_url")


class Dumper(yaml.SafeDumper):
    """Indented sequences, folded long strings, literal multi-line ones: yamllint-clean."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)


def _str(dumper, value):
    style = "|" if "\n" in value else (">" if len(value) > 100 else None)
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


Dumper.add_representer(str, _str)


def _ordered(mapping, keys):
    """jsonnet sorts keys; put them back in the order a reader expects."""
    first = {k: mapping[k] for k in keys if k in mapping}
    return {**first, **{k: v for k, v in mapping.items() if k not in first}}


def _readable(rules):
    groups = []
    for group in rules["groups"]:
        out = _ordered(group, ("name", "interval", "rules"))
        out["rules"] = []
        for rule in group["rules"]:
            rule = _ordered(rule, RULE_KEYS)
            if "annotations" in rule:
                rule["annotations"] = _ordered(rule["annotations"], ANNOTATION_KEYS)
            out["rules"].append(rule)
        groups.append(out)
    return {"groups": groups}


def evaluate(jsonnet=None, snippet=None):
    """The mixin as JSON: render.jsonnet, or a jsonnet snippet evaluated in deploy/mixin."""
    binary = jsonnet or shutil.which("jsonnet")
    if not binary:
        raise SystemExit("jsonnet not found: apt-get install jsonnet")
    args = [binary, "-J", HERE] + (["-e", snippet] if snippet else [os.path.join(HERE, "render.jsonnet")])
    result = subprocess.run(args, capture_output=True, text=True, cwd=HERE)
    if result.returncode != 0:
        raise SystemExit(f"jsonnet failed: {result.stderr.strip()}")
    return json.loads(result.stdout)


def dump_rules(rules):
    return HEADER + yaml.dump(_readable(rules), Dumper=Dumper, sort_keys=False, width=110)


def dump_prometheusrule(rules, name, source):
    manifest = {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": name, "labels": {"app.kubernetes.io/name": "shmwatch", "release": "prometheus"}},
        "spec": _readable(rules),
    }
    return (f"# The groups of {source} for the Prometheus Operator.\n" + HEADER + "---\n"
            + yaml.dump(manifest, Dumper=Dumper, sort_keys=False, width=110))


def files(rendered):
    """{repository path: text} for everything the mixin renders."""
    out = {"grafana/shmwatch.json": json.dumps(rendered["grafana/shmwatch.json"], indent=2) + "\n"}
    for plain, operator, name in OPERATOR:
        out[plain] = dump_rules(rendered[plain])
        out[operator] = dump_prometheusrule(rendered[plain], name, plain)
    return out


def main(argv):
    root = argv[0] if argv else REPO
    for path, text in files(evaluate()).items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
