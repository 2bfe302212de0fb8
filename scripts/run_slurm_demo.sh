#!/usr/bin/env bash
# The offline default's DAG through SLURM, with the shipped profile (profiles/slurm), to a complete
# card in a fresh working directory; then checks that the card exists and that SLURM ran every job.
#
# Needs a running cluster: scripts/slurm_localhost.sh starts one on this machine.
#   scripts/run_slurm_demo.sh                       # full card, in a new /tmp/talkmethods-slurm.XXXX
#   SLURM_DEMO_DIR=/path/new-dir scripts/run_slurm_demo.sh
#   SLURM_DEMO_TARGETS="results/raft/seed17/eval.json" scripts/run_slurm_demo.sh   # a smaller DAG
#   SLURM_DEMO_CONFIG="/path/two-arms.yaml" scripts/run_slurm_demo.sh   # overlays after offline.yaml (space-separated)
# Installs snakemake-executor-plugin-slurm==2.8.0 into the venv if it is missing.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PROFILE="$REPO/profiles/slurm"
PLUGIN="snakemake-executor-plugin-slurm==2.8.0"
TARGETS=${SLURM_DEMO_TARGETS:-"results/card.md results/card.png"}
CONFIGS=${SLURM_DEMO_CONFIG:-}

say() { echo "run_slurm_demo: $*" >&2; }
die() { say "error: $*"; exit 1; }

if [[ -x "$REPO/.venv/bin/python" ]]; then PY="$REPO/.venv/bin/python"; else PY=$(command -v python3); fi

# --- plugin and cluster --------------------------------------------------------------------------
if ! "$PY" -c "import snakemake_executor_plugin_slurm" 2>/dev/null; then
    say "installing $PLUGIN"
    "$PY" -m pip install -q "$PLUGIN" || die "pip install $PLUGIN failed"
fi
timeout 10 sinfo -h >/dev/null 2>&1 || die "no SLURM cluster answers sinfo: start one with scripts/slurm_localhost.sh"

# Every request in the profile must fit the node, or sbatch refuses the job.
node_mem=$(timeout 10 scontrol show node -o | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' | sort -n | tail -1)
max_req=$("$PY" - "$PROFILE/config.yaml" <<'PY'
import sys, yaml
p = yaml.safe_load(open(sys.argv[1]))
reqs = [p.get("default-resources", {}).get("mem_mb", 0)]
reqs += [r.get("mem_mb", 0) for r in (p.get("set-resources") or {}).values()]
print(max(int(r) for r in reqs))
PY
)
if [[ -n "$node_mem" ]] && ((max_req > node_mem)); then
    die "the profile asks for up to ${max_req} MB (mem_mb) but the largest node has ${node_mem} MB: lower mem_mb in $PROFILE/config.yaml"
fi

# --- the run -------------------------------------------------------------------------------------
if [[ -n "${SLURM_DEMO_DIR:-}" ]]; then
    WORKDIR=$SLURM_DEMO_DIR
    if [[ -e "$WORKDIR" ]] && [[ -n "$(ls -A "$WORKDIR")" ]]; then
        die "$WORKDIR exists and is not empty: the demo wants a fresh working directory"
    fi
    mkdir -p "$WORKDIR"
else
    WORKDIR=$(mktemp -d /tmp/talkmethods-slurm.XXXXXX)
fi
WORKDIR=$(cd "$WORKDIR" && pwd)
OUT="$WORKDIR/snakemake.out"

# shellcheck disable=SC2206
targets=($TARGETS)
# shellcheck disable=SC2206
overlays=($CONFIGS)
for c in "${overlays[@]}"; do [[ -r "$c" ]] || die "SLURM_DEMO_CONFIG: cannot read $c"; done
cmd=("$PY" -m snakemake --snakefile "$REPO/Snakefile" --directory "$WORKDIR"
    --configfile "$REPO/offline.yaml" "${overlays[@]}" --profile "$PROFILE" "${targets[@]}")
say "working directory $WORKDIR"
say "${cmd[*]}"
t0=$(date +%s)
set +e
(cd "$WORKDIR" && "${cmd[@]}") >"$OUT" 2>&1
rc=$?
set -e
t1=$(date +%s)
if ((rc != 0)); then
    tail -n 40 "$OUT" >&2
    die "snakemake failed (exit $rc) after $((t1 - t0)) s: $OUT, SLURM logs under $WORKDIR/.snakemake/slurm_logs"
fi

# --- checks --------------------------------------------------------------------------------------
for t in "${targets[@]}"; do
    [[ -s "$WORKDIR/$t" ]] || die "target $t is missing or empty"
done
if [[ " ${targets[*]} " == *" results/card.png "* ]]; then
    [[ "$(head -c 8 "$WORKDIR/results/card.png" | od -An -tx1 | tr -d ' \n')" == 89504e470d0a1a0a ]] \
        || die "results/card.png is not a PNG"
fi

# Snakemake's count of jobs, and the SLURM job ids it was given: one per job.
n_jobs=$(awk '$1 == "total" {print $2; exit}' "$OUT")
mapfile -t ids < <(sed -n 's/.*has been submitted with SLURM jobid \([0-9]*\).*/\1/p' "$OUT" | sort -un)
[[ -n "$n_jobs" ]] || die "no job count in $OUT"
# Rules listed in `localrules:` (cheap bookkeeping) run where snakemake runs, by design.
n_local=$(grep -c '^localrule ' "$OUT" || true)
((${#ids[@]} == n_jobs - n_local)) \
    || die "snakemake ran $n_jobs jobs ($n_local local rules) but ${#ids[@]} went through SLURM"

# SLURM's side: every id COMPLETED, by the jobcomp text log (scripts/slurm_localhost.sh writes one),
# sacct where accounting runs, or squeue (which forgets a job MinJobAge seconds after it ends).
jobcomp=$(timeout 10 scontrol show config | awk '$1 == "JobCompType" {t = $3} $1 == "JobCompLoc" {l = $3}
    END {if (t == "jobcomp/filetxt") print l}')
missing=()
for id in "${ids[@]}"; do
    st=""
    if [[ -n "$jobcomp" && -r "$jobcomp" ]]; then
        st=$(grep -o "^JobId=$id .*JobState=[A-Z_]*" "$jobcomp" | sed 's/.*JobState=//' | tail -1 || true)
    fi
    [[ -n "$st" ]] || st=$(sacct -X -n -P -j "$id" -o State 2>/dev/null | head -1 || true)
    [[ -n "$st" ]] || st=$(squeue -h --states=all -j "$id" -o %T 2>/dev/null | head -1 || true)
    [[ "$st" == COMPLETED ]] || missing+=("$id:${st:-unknown}")
done
((${#missing[@]} == 0)) || die "SLURM does not report these jobs COMPLETED: ${missing[*]}"

say "ok: $n_jobs jobs, all through SLURM (job ids ${ids[0]}..${ids[-1]}), in $((t1 - t0)) s"
say "outputs: ${targets[*]/#/$WORKDIR/}"
echo "SLURM_DEMO_SECONDS=$((t1 - t0)) SLURM_DEMO_JOBS=$n_jobs SLURM_DEMO_DIR=$WORKDIR"
