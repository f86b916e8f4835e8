#!/usr/bin/env bash
# A Slurm cluster of emulated nodes on this machine, for the tests (tests/test_slurm.py) and for trying the
# Slurm launcher without a cluster: one slurmctld and one slurmd per node, all on localhost, each slurmd standing
# for a node (NodeName n1..nN, its own port). Debian's slurm-wlm and munge packages (Slurm 22.05); installed
# here when missing and this user may (root with apt-get).
#
#   launch/slurm_emulated.sh up DIR [NODES]   start N nodes (default 4), state and logs under DIR; prints the
#                                             line to export (SLURM_CONF=DIR/slurm.conf)
#   launch/slurm_emulated.sh down DIR         cancel every job and stop the daemons of DIR
#
# Exit 3: Slurm is not installed and cannot be (the tests skip, naming the reason); 1: it did not come up.
# Every node reports `hostname` as this machine, so a task's node is SLURMD_NODENAME, not its hostname.
# LLAMA_JAX_SLURM_PORT (default 16817): slurmctld's port; the nodes take the next ones.
set -euo pipefail

action="${1:-}"; dir="${2:-}"; nodes="${3:-4}"
if [[ -z "$action" || -z "$dir" ]]; then
  echo "usage: $0 up|down DIR [NODES]" >&2; exit 2
fi
mkdir -p "$dir"; dir="$(cd "$dir" && pwd)"
export SLURM_CONF="$dir/slurm.conf"

install() {
  command -v slurmctld >/dev/null && command -v munged >/dev/null && return 0
  if [[ "$(id -u)" != 0 ]] || ! command -v apt-get >/dev/null; then
    echo "slurm_emulated: slurm-wlm and munge are not installed and this user cannot apt-get them" >&2; exit 3
  fi
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >"$dir/apt.log" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q >>"$dir/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >>"$dir/apt.log" 2>&1 || {
      echo "slurm_emulated: apt-get install slurm-wlm munge failed (see $dir/apt.log)" >&2; exit 3; }
  fi
}

start_munge() {
  munge -n >/dev/null 2>&1 && return 0  # a munged already answers
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [[ -f /etc/munge/munge.key ]] || { mungekey --create >/dev/null 2>&1 || /usr/sbin/create-munge-key -f; }
  chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key
  runuser -u munge -- /usr/sbin/munged
  for _ in $(seq 50); do munge -n >/dev/null 2>&1 && return 0; sleep 0.1; done
  echo "slurm_emulated: munged did not start" >&2; exit 1
}

write_conf() {
  local port="${LLAMA_JAX_SLURM_PORT:-16817}"
  mkdir -p "$dir/state" "$dir/spool"
  cat >"$SLURM_CONF" <<CONF
ClusterName=llamajax
SlurmctldHost=localhost
SlurmctldPort=$port
AuthType=auth/munge
CredType=cred/munge
# A requeued job may start again once its old job credential has expired: 10 s here instead of Slurm's 120.
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=1,bf_interval=1
ReturnToService=2
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=600
NodeName=n[1-$nodes] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((port + 1))-$((port + nodes)) CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n[1-$nodes] Default=YES MaxTime=INFINITE State=UP
CONF
}

stop() {
  if [[ -f "$SLURM_CONF" ]]; then
    scancel --quiet --full --partition debug 2>/dev/null || true
    # scancel only asks: the jobs' processes end through their nodes' daemons (KillWait 5 s), which must still be
    # up; a job left behind would meet the next cluster on these ports under the same job id.
    for _ in $(seq 150); do [[ -z "$(squeue -h 2>/dev/null)" ]] && break; sleep 0.1; done
  fi
  for pidfile in "$dir"/slurmd-*.pid "$dir"/slurmctld.pid; do
    [[ -f "$pidfile" ]] && kill "$(cat "$pidfile")" 2>/dev/null || true
    rm -f "$pidfile"
  done
}

case "$action" in
  up)
    install
    [[ "$(id -u)" == 0 ]] || { echo "slurm_emulated: the daemons run as root here; run as root" >&2; exit 3; }
    start_munge
    stop
    write_conf
    slurmctld -f "$SLURM_CONF"
    for ((n = 1; n <= nodes; n++)); do slurmd -f "$SLURM_CONF" -N "n$n"; done
    for _ in $(seq 100); do
      idle=$(sinfo -h -o '%D %t' 2>/dev/null | awk '$2 == "idle" {s += $1} END {print s + 0}')
      [[ "$idle" == "$nodes" ]] && { echo "export SLURM_CONF=$SLURM_CONF"; exit 0; }
      sleep 0.2
    done
    echo "slurm_emulated: the nodes did not come up (see $dir/slurmctld.log)" >&2; stop; exit 1 ;;
  down) stop ;;
  *) echo "usage: $0 up|down DIR [NODES]" >&2; exit 2 ;;
esac
