#!/usr/bin/env bash
# One start of the job step launch/slurm.sbatch supervises (every restart runs this again):
#
#   slurm_step.sh NODES PER_NODE PORT COMMAND...
#
# It picks NODES healthy nodes of the job's allocation in their order, skipping any that Slurm removed from it or
# reports DOWN, DRAINED, FAILED or NOT_RESPONDING: with spare nodes in the allocation (sbatch --no-kill, slurm.sbatch --spares), a spare
# takes a failed node's place at the restart, inside the same allocation, with no new submission and no queue.
# Process 0, on the first node picked, hosts the coordinator at that node's address (NodeAddr: a node's name need
# not resolve) and PORT. Then `srun` runs COMMAND as PER_NODE tasks on each node, each told its place in the run.
#
# A SIGTERM or SIGINT for the step goes to its tasks through Slurm (scancel --signal, which leaves the batch script
# alone) instead of to srun: on SIGTERM srun forces the step's termination at once (the tasks are killed), and a
# preempted task must get the time to save its checkpoint and exit 75. srun runs in a process group of its own
# (set -m), so the signal the supervisor sends to this script's group reaches only this script.
set -uo pipefail
nodes="$1" per_node="$2" port="$3"; shift 3

# The job's nodes now: Slurm removes a failed node from a --no-kill job's allocation (SLURM_JOB_NODELIST still names it).
allocated=$(scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null | sed -n 's/.* NodeList=\([^ ]*\).*/\1/p' || true)
[[ -z "$allocated" || "$allocated" == "(null)" ]] && allocated="$SLURM_JOB_NODELIST"
healthy=()
while read -r node; do
  state=$(scontrol show node "$node" -o 2>/dev/null | sed -n 's/.*State=\([^ ]*\).*/\1/p' || true)
  case "$state" in *DOWN* | *DRAIN* | *FAIL* | *NOT_RESPONDING*) echo "slurm_step: node $node is $state: not used" >&2 ;;
    *) healthy+=("$node") ;;
  esac
done < <(scontrol show hostnames "$allocated")
if [[ ${#healthy[@]} -lt $nodes ]]; then
  echo "slurm_step: ${#healthy[@]} healthy node(s) in the allocation (${healthy[*]:-none}), $nodes needed and no" \
       "spare left; waiting for the supervisor's next restart" >&2
  exit 1
fi
use=("${healthy[@]:0:$nodes}")
address=$(scontrol show node "${use[0]}" -o 2>/dev/null | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p' || true)
coordinator="${address:-${use[0]}}:$port"
spare_nodes="${healthy[*]:$nodes}"
echo "slurm_step: on ${use[*]}${spare_nodes:+; spare(s): $spare_nodes}" >&2

# What srun runs on every task: the process's place in the run comes from Slurm's task variables.
task='exec env JAX_COORDINATOR_ADDRESS="$0" JAX_NUM_PROCESSES="$SLURM_NTASKS" JAX_PROCESS_ID="$SLURM_PROCID" JAX_LOCAL_DEVICE_IDS="$SLURM_LOCALID" "$@"'
set -m
srun --kill-on-bad-exit=1 --nodes="$nodes" --ntasks=$((nodes * per_node)) --nodelist="$(IFS=,; echo "${use[*]}")" --ntasks-per-node="$per_node" \
  bash -c "$task" "$coordinator" "$@" &
step=$!
trap 'scancel --signal=TERM "$SLURM_JOB_ID"' TERM INT
wait "$step"; status=$?
while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done
exit "$status"
