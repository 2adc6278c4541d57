"""Exposition: the model as Prometheus families, rendered on demand and served over HTTP(S)."""
