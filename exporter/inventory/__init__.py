"""The segment inventory's parts, joined by collectors/segments.py."""
