#!/usr/bin/env bash
# The toy-world comparison on one GPU (world-gpu.yaml), as run on the H200 for docs/world_gpu_card.md.
#   bash scripts/world_gpu.sh [seconds]   # stops Snakemake after that many seconds (default: no limit)
# Run it again to go on: Snakemake picks up where it stopped (--rerun-incomplete; training resumes
# from its checkpoints). Packages the host lacks come from .whl/site.tar.xz (scripts/device_site.sh) or
# wheels in .whl/ (see README), installed first.
# What a reader needs comes back in $OUT (or .gpu/): the card, the summary, the step logs and timings.
set -uo pipefail
limit=${1:-0}
jobs=${JOBS:-8}
out=${OUT:-.gpu}
mkdir -p "$out"
if [ -f .whl/site.tar.xz ]; then  # packed by scripts/device_site.sh; unpacked and byte-compiled
  source scripts/device_env.sh || exit 1
elif compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export TALKMETHODS_JOBS_PER_GPU=$jobs PYTHONUNBUFFERED=1
run=(python3 -m snakemake --configfile world-gpu.yaml -j"$jobs" --scheduler greedy --rerun-incomplete
     --keep-going results/card.md results/card.png)
t0=$(date +%s)
status=0
if [ "$limit" -gt 0 ]; then timeout --signal=INT "$limit" "${run[@]}" >> "$out/snakemake.log" 2>&1 || status=$?
else "${run[@]}" >> "$out/snakemake.log" 2>&1 || status=$?; fi
echo "snakemake exit $status after $(( $(date +%s) - t0 )) s" | tee -a "$out/snakemake.log"
sleep 2
python3 -m snakemake --unlock --configfile world-gpu.yaml > /dev/null 2>&1 || true
cp results/card.md results/card.png results/summary.json "$out"/ 2>/dev/null || true
tar czf "$out/logs.tgz" results/*/seed*/train_log.jsonl results/*/seed*/*.json results/base/eval.json \
  results/warmstart/stats.json results/benchmarks results/lr_sweep/sweep.md 2>/dev/null || true
grep -h "step .* reward" results/logs/train/*.log 2>/dev/null | tail -3
ls results/*/seed*/eval.json 2>/dev/null | wc -l
exit $status
