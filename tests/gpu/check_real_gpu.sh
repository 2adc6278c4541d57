#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: start shmwatch, scrape once, and compare
# shmwatch_gpu_memory_used_bytes with nvidia-smi's memory.used (MiB), GPU by GPU.
# Usage: tests/gpu/check_real_gpu.sh [port]
set -euo pipefail
cd "$(dirname "$0")/../.."
port="${1:-19841}"
command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: no NVIDIA driver here" >&2; exit 2; }

python3 -m exporter --web.listen-address="127.0.0.1:${port}" --no-collector.segments &
pid=$!
trap 'kill "$pid" 2>/dev/null || true' EXIT
for _ in $(seq 50); do
    curl -sf "http://127.0.0.1:${port}/metrics" | grep -q '^shmwatch_gpu_memory_used_bytes' && break
    sleep 0.2
done
scrape="$(curl -sf "http://127.0.0.1:${port}/metrics")"
smi="$(nvidia-smi --query-gpu=index,memory.used --format=csv,noheader,nounits)"

status=0
printf '%-4s %16s %16s %10s\n' gpu shmwatch_MiB nvidia-smi_MiB diff_MiB
while IFS=', ' read -r index used_mib; do
    bytes="$(grep -E "^shmwatch_gpu_memory_used_bytes\{gpu=\"${index}\"," <<<"$scrape" | awk '{print $2}' | head -1)"
    if [ -z "$bytes" ]; then echo "gpu ${index}: no shmwatch series"; status=1; continue; fi
    ours="$(python3 -c "print(round(float('${bytes}') / 1048576))")"
    diff=$(( ours - used_mib ))
    printf '%-4s %16s %16s %10s\n' "$index" "$ours" "$used_mib" "$diff"
    # Both sample at slightly different moments: allow 1 % or 64 MiB.
    if [ "${diff#-}" -gt 64 ] && [ "${diff#-}" -gt $(( used_mib / 100 )) ]; then status=1; fi
done <<<"$smi"
exit "$status"
