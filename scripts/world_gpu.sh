#!/usr/bin/env bash
# The toy-world comparison on one GPU (world-gpu.yaml), as run on the H200 for docs/world_gpu_card.md.
#   bash scripts/world_gpu.sh [seconds]   # stops Snakemake after that many seconds (default: no limit)
# Resumable: results/, .snakemake/metadata and checkpoints/ from an earlier call, packed as
# .gpu/state.tgz, are unpacked first; on the way out the same three are packed into $OUT (or .gpu/).
# Wheels in .whl/ (pip download, see README) are installed first where the machine lacks packages.
set -euo pipefail
limit=${1:-0}
jobs=${JOBS:-6}
out=${OUT:-.gpu}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
[ -f .gpu/state.tgz ] && tar xzf .gpu/state.tgz
export TALKMETHODS_JOBS_PER_GPU=$jobs PYTHONUNBUFFERED=1
run=(python3 -m snakemake --configfile world-gpu.yaml -j"$jobs" --scheduler greedy --rerun-incomplete
     --rerun-triggers params --keep-going results/card.md results/card.png)
t0=$(date +%s)
status=0
if [ "$limit" -gt 0 ]; then timeout --signal=INT "$limit" "${run[@]}" > "$out/snakemake.log" 2>&1 || status=$?
else "${run[@]}" > "$out/snakemake.log" 2>&1 || status=$?; fi
echo "snakemake exit $status after $(( $(date +%s) - t0 )) s" | tee -a "$out/snakemake.log"
python3 -m snakemake --unlock --configfile world-gpu.yaml > /dev/null 2>&1 || true
tar czf "$out/state.tgz" results .snakemake/metadata $( [ -d checkpoints ] && echo checkpoints )
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv > "$out/gpu.txt" 2>&1 || true
