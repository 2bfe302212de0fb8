#!/usr/bin/env bash
# A single-node SLURM cluster on this machine (DESIGN §5), for trying the SLURM profile and for CI.
#
# Idempotent: installs Debian's slurm-wlm and munge if missing, writes /etc/slurm/slurm.conf
# (NodeName=localhost with this machine's CPUs and memory, one default partition `main`), starts
# munged (as the munge user), slurmctld and slurmd directly (no systemd), and waits until `sinfo`
# shows the node idle. Run again: a running cluster with the same config is left alone; a changed
# config restarts the daemons. Needs root and apt-get.
#
# GPUs: a host with NVIDIA GPUs gets them as GRES gpu (File=/dev/nvidiaN). A host without gets
# SLURM_LOCALHOST_GPUS (default 2) *fake* GPUs: GRES entries backed by /dev/null twins, so that
# `sbatch --gpus=1` (what the profile asks for) schedules, and SLURM still sets
# CUDA_VISIBLE_DEVICES per job as on a real cluster; the jobs themselves run on the CPU.
# SLURM_LOCALHOST_GPUS=0 configures no GPUs at all.
#
# Stop it:  scripts/slurm_localhost.sh stop
set -euo pipefail

STATE=/var/lib/slurm-localhost       # the fake GPU device files
CONF_DIR=/etc/slurm
LOG_DIR=/var/log/slurm
PARTITION=main

say() { echo "slurm_localhost: $*" >&2; }
die() { say "error: $*"; exit 1; }

pid_alive() {  # running, not a zombie
    local st
    st=$(sed -n 's/^.*) \([A-Z]\).*/\1/p' "/proc/${1:-x}/stat" 2>/dev/null) || return 1
    [[ -n "$st" && "$st" != Z ]]
}
pidfile_alive() { [[ -s "$1" ]] && pid_alive "$(cat "$1")"; }
wait_pidfile() {  # a daemon writes its pid file a moment after its launcher returns
    for _ in $(seq 100); do pidfile_alive "$1" && return 0; sleep 0.1; done
    return 1
}

stop_daemons() {
    # Only the daemons this script started, by the pid files they wrote.
    local f pid
    for f in /run/slurmd.pid /run/slurmctld.pid; do
        if pidfile_alive "$f"; then
            pid=$(cat "$f")
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do pid_alive "$pid" || break; sleep 0.2; done
            # a slurmd stuck registering with a dead slurmctld ignores SIGTERM
            pid_alive "$pid" && kill -9 "$pid" 2>/dev/null || true
        fi
        rm -f "$f"
    done
}

if [[ "${1:-}" == "stop" ]]; then
    stop_daemons
    say "slurmctld and slurmd stopped (munged left running)"
    exit 0
fi

[[ $(id -u) -eq 0 ]] || die "must run as root (it installs packages and starts system daemons)"

t0=$(date +%s)

# --- packages ----------------------------------------------------------------------------------
need=()
for cmd in slurmctld slurmd sinfo squeue sbatch munged; do
    command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || need+=("$cmd")
done
if ((${#need[@]})); then
    command -v apt-get >/dev/null 2>&1 \
        || die "missing ${need[*]} and no apt-get: install SLURM (slurmctld, slurmd, client) and munge by hand"
    say "installing slurm-wlm and munge (missing: ${need[*]})"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq || die "apt-get update failed (no network or no package mirror?)"
    apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null \
        || die "apt-get install slurm-wlm munge failed"
fi
t_pkg=$(date +%s)

# --- munge ---------------------------------------------------------------------------------------
if [[ ! -s /etc/munge/munge.key ]]; then
    if command -v mungekey >/dev/null 2>&1; then
        mungekey --create --keyfile=/etc/munge/munge.key
    else
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
    fi
fi
chown munge:munge /etc/munge/munge.key && chmod 0400 /etc/munge/munge.key
install -d -o munge -g munge -m 0755 /run/munge
install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged --force
    for _ in $(seq 50); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.1; done
    munge -n | unmunge >/dev/null || die "munged does not answer (see /var/log/munge/munged.log)"
fi

# --- slurm.conf ----------------------------------------------------------------------------------
cpus=$(nproc --all)
mem_mb=$(awk '/^MemTotal:/ {print int($2 / 1024)}' /proc/meminfo)
real_mem=$((mem_mb * 95 / 100))  # a little under the total: slurmd drains a node that claims more

install -d "$STATE" "$CONF_DIR" "$LOG_DIR" /var/spool/slurmctld /var/spool/slurmd

gres_line="" gres_types=""
n_real=0
if command -v nvidia-smi >/dev/null 2>&1; then
    n_real=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ' || true)
fi
if ((n_real > 0)); then
    n_gpu=$n_real
    gpu_files="/dev/nvidia[0-$((n_gpu - 1))]"
else
    n_gpu=${SLURM_LOCALHOST_GPUS:-2}
    gpu_files="$STATE/fakegpu[0-$((n_gpu - 1))]"
    # slurmd wants character devices: each fake GPU is a /dev/null twin (char 1:3).
    for ((i = 0; i < n_gpu; i++)); do
        f="$STATE/fakegpu$i"
        [[ -c "$f" ]] || { rm -f "$f"; mknod -m 0666 "$f" c 1 3; } \
            || die "cannot create the fake GPU device $f (mknod); SLURM_LOCALHOST_GPUS=0 configures none"
    done
fi
if ((n_gpu > 0)); then
    gres_types="GresTypes=gpu"
    gres_line="Gres=gpu:$n_gpu"
fi

new_conf=$(mktemp)
cat >"$new_conf" <<CONF
# Written by scripts/slurm_localhost.sh: a single-node cluster on localhost (DESIGN §5).
ClusterName=localhost
SlurmctldHost=localhost
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOG_DIR/slurmctld.log
SlurmdLogFile=$LOG_DIR/slurmd.log
# No cgroups and no accounting daemon here (DESIGN §5).
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
# Every finished job gets a line here, so a test can see what SLURM ran without slurmdbd.
JobCompType=jobcomp/filetxt
JobCompLoc=$LOG_DIR/jobcomp.log
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
SchedulerType=sched/backfill
ReturnToService=2
# Finished jobs stay visible to squeue for 5 minutes: the profile polls with squeue.
MinJobAge=300
SlurmctldTimeout=30
SlurmdTimeout=60
$gres_types
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$real_mem $gres_line State=UNKNOWN
PartitionName=$PARTITION Nodes=localhost Default=YES MaxTime=INFINITE State=UP
CONF
new_gres=$(mktemp)
if ((n_gpu > 0)); then
    echo "NodeName=localhost Name=gpu File=$gpu_files" >"$new_gres"
fi

changed=0
cmp -s "$new_conf" "$CONF_DIR/slurm.conf" || changed=1
if [[ -s "$new_gres" ]]; then
    cmp -s "$new_gres" "$CONF_DIR/gres.conf" || changed=1
elif [[ -e "$CONF_DIR/gres.conf" ]]; then
    changed=1
fi
if ((changed)); then
    say "writing $CONF_DIR/slurm.conf (CPUs=$cpus RealMemory=$real_mem GPUs=$n_gpu$( ((n_real == 0 && n_gpu > 0)) && echo ' fake'))"
    stop_daemons
    install -m 0644 "$new_conf" "$CONF_DIR/slurm.conf"
    if [[ -s "$new_gres" ]]; then install -m 0644 "$new_gres" "$CONF_DIR/gres.conf"; else rm -f "$CONF_DIR/gres.conf"; fi
fi
rm -f "$new_conf" "$new_gres"

# --- daemons -------------------------------------------------------------------------------------
started=0
if ! pidfile_alive /run/slurmctld.pid; then
    started=1
    say "starting slurmctld"
    slurmctld && wait_pidfile /run/slurmctld.pid \
        || die "slurmctld failed to start: $(tail -n 3 "$LOG_DIR/slurmctld.log")"
fi
if ! pidfile_alive /run/slurmd.pid; then
    started=1
    say "starting slurmd"
    slurmd -N localhost && wait_pidfile /run/slurmd.pid \
        || die "slurmd failed to start: $(tail -n 3 "$LOG_DIR/slurmd.log")"
fi

# --- wait for the node ---------------------------------------------------------------------------
state=""
for _ in $(seq 120); do
    pidfile_alive /run/slurmctld.pid || die "slurmctld died: $(tail -n 3 "$LOG_DIR/slurmctld.log")"
    pidfile_alive /run/slurmd.pid || die "slurmd died: $(tail -n 3 "$LOG_DIR/slurmd.log")"
    state=$(timeout 5 sinfo -h -N -n localhost -o %t 2>/dev/null | head -1 || true)
    case "$state" in
        idle | mix | alloc) break ;;
        down* | drain* | drng*)
            timeout 5 scontrol update NodeName=localhost State=RESUME 2>/dev/null || true ;;
    esac
    sleep 0.5
done
case "$state" in
    idle | mix | alloc) ;;
    *) die "node localhost is '${state:-not listed}' after 60 s (see $LOG_DIR/slurmctld.log, $LOG_DIR/slurmd.log; sinfo -R)" ;;
esac

# A restarted slurmctld reports the node's saved state before slurmd has registered: run one
# tiny job to know that munge, slurmctld and slurmd really work together.
if ((started)); then
    timeout 60 srun --quiet -N1 -n1 -t 1 --mem=16 true \
        || die "a test job (srun true) did not run within 60 s (see $LOG_DIR/slurmctld.log, $LOG_DIR/slurmd.log)"
fi

t1=$(date +%s)
say "cluster up: node localhost $state, partition $PARTITION, $(sinfo -V) (packages $((t_pkg - t0)) s, total $((t1 - t0)) s)"
