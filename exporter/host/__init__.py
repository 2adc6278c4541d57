"""Reading the host: paths under the injected roots, mountinfo, the process table, Kubernetes paths."""
