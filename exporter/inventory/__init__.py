"""The segment inventory's parts: the directory walk and its patching, the owner scan over
/proc, the names inotify saw change, and the per-mount summaries. The collector that joins
them is collectors/segments.py."""
