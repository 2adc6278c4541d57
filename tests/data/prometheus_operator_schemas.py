"""The structure the Prometheus Operator CRDs (monitoring.coreos.com/v1, operator 0.82)
require of the PodMonitor and PrometheusRule fields our manifests use, as JSON Schema.

Written from the CRDs' openAPIV3Schema (example/prometheus-operator-crd/ in the operator's
repository): required keys, types, the duration pattern and the relabel action enum.
Unknown keys are rejected where the CRD has no x-kubernetes-preserve-unknown-fields, so a
typo ('podMetricEndpoints') fails here as it would at `kubectl apply`.
"""

DURATION = r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"
STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
METADATA = {"type": "object", "required": ["name"],
            "properties": {"name": {"type": "string", "minLength": 1}, "namespace": {"type": "string"},
                           "labels": STRING_MAP, "annotations": STRING_MAP}}
LABEL_SELECTOR = {"type": "object", "additionalProperties": False,
                  "properties": {"matchLabels": STRING_MAP, "matchExpressions": {"type": "array"}}}
RELABEL = {
    "type": "object", "additionalProperties": False,
    "properties": {
        "sourceLabels": {"type": "array", "items": {"type": "string", "pattern": "^[a-zA-Z_][a-zA-Z0-9_]*$"}},
        "separator": {"type": "string"}, "targetLabel": {"type": "string"}, "regex": {"type": "string"},
        "modulus": {"type": "integer"}, "replacement": {"type": "string"},
        "action": {"enum": ["replace", "Replace", "keep", "Keep", "drop", "Drop", "hashmod", "HashMod",
                            "labelmap", "LabelMap", "labeldrop", "LabelDrop", "labelkeep", "LabelKeep",
                            "lowercase", "Lowercase", "uppercase", "Uppercase", "keepequal", "KeepEqual",
                            "dropequal", "DropEqual"]},
    },
}

PODMONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PodMonitor"}, "metadata": METADATA,
        "spec": {
            "type": "object", "required": ["selector"], "additionalProperties": False,
            "properties": {
                "selector": LABEL_SELECTOR,
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "podTargetLabels": {"type": "array", "items": {"type": "string"}},
                "podMetricsEndpoints": {"type": "array", "items": {
                    "type": "object", "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "portNumber": {"type": "integer"},
                        "path": {"type": "string"}, "scheme": {"enum": ["http", "https", "HTTP", "HTTPS"]},
                        "interval": {"type": "string", "pattern": DURATION},
                        "scrapeTimeout": {"type": "string", "pattern": DURATION},
                        "honorLabels": {"type": "boolean"},
                        "relabelings": {"type": "array", "items": RELABEL},
                        "metricRelabelings": {"type": "array", "items": RELABEL},
                        "tlsConfig": {"type": "object"},
                    },
                }},
            },
        },
    },
}

PROMETHEUSRULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"}, "metadata": METADATA,
        "spec": {
            "type": "object", "additionalProperties": False,
            "properties": {"groups": {"type": "array", "items": {
                "type": "object", "required": ["name"], "additionalProperties": False,
                "properties": {
                    "name": {"type": "string", "minLength": 1},
                    "interval": {"type": "string", "pattern": DURATION},
                    "limit": {"type": "integer"},
                    "labels": STRING_MAP,
                    "rules": {"type": "array", "items": {
                        "type": "object", "required": ["expr"], "additionalProperties": False,
                        "properties": {
                            "alert": {"type": "string"}, "record": {"type": "string"},
                            "expr": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
                            "for": {"type": "string", "pattern": DURATION},
                            "keep_firing_for": {"type": "string", "pattern": DURATION},
                            "labels": STRING_MAP, "annotations": STRING_MAP,
                        },
                    }},
                },
            }}},
        },
    },
}

SCHEMAS = {("monitoring.coreos.com/v1", "PodMonitor"): PODMONITOR,
           ("monitoring.coreos.com/v1", "PrometheusRule"): PROMETHEUSRULE}
