#!/usr/bin/env bash
# One start of the job step launch/slurm.sbatch supervises (every restart runs this again):
#
#   slurm_step.sh NODES PER_NODE PORT COMMAND...
#
# It picks NODES healthy nodes of the job's allocation in their order, skipping any that Slurm removed from it or
# reports DOWN, DRAINED, FAILED or NOT_RESPONDING: with spare nodes in the allocation (sbatch --no-kill, slurm.sbatch --spares), a spare
# takes a failed node's place at the restart, inside the same allocation, with no new submission and no queue.
# With no spare left it continues on fewer: the largest count of healthy nodes that divides NODES (the local
# launcher's rule, launch/multiprocess.py), with run.full_processes so the global batch and the math stay the same
# (more micro-batches per process). While it runs on fewer it looks at the nodes every LLAMA_JAX_GROW_POLL_S
# seconds (default 30): once NODES are healthy again (a drained node resumed: a node Slurm removed from the
# allocation does not come back to it), it asks the step's tasks to save and exit 75 (SIGTERM), and the
# supervisor's restart runs on all NODES.
# Process 0, on the first node picked, hosts the coordinator at that node's address (NodeAddr: a node's name need
# not resolve) and PORT. Then `srun` runs COMMAND as PER_NODE tasks on each node, each told its place in the run.
#
# A SIGTERM or SIGINT for the step goes to its tasks through Slurm (scancel --signal, which leaves the batch script
# alone) instead of to srun: on SIGTERM srun forces the step's termination at once (the tasks are killed), and a
# preempted task must get the time to save its checkpoint and exit 75. srun runs in a process group of its own
# (set -m), so the signal the supervisor sends to this script's group reaches only this script.
set -uo pipefail
nodes="$1" per_node="$2" port="$3"; shift 3

# The job's healthy nodes now, in their order: Slurm removes a failed node from a --no-kill job's allocation
# (SLURM_JOB_NODELIST still names it); a DOWN, DRAINED, FAILED or NOT_RESPONDING one stays out. Sets `healthy`.
find_healthy() {
  local allocated node state
  allocated=$(scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null | sed -n 's/.* NodeList=\([^ ]*\).*/\1/p' || true)
  [[ -z "$allocated" || "$allocated" == "(null)" ]] && allocated="$SLURM_JOB_NODELIST"
  healthy=()
  while read -r node; do
    if [[ ",${LLAMA_JAX_EXCLUDE_NODES:-}," == *",$node,"* ]]; then  # slurm.sbatch: named by the pre-flight check
      [[ -n "${1:-}" ]] && echo "slurm_step: node $node was named by the pre-flight check: not used" >&2
      continue
    fi
    state=$(scontrol show node "$node" -o 2>/dev/null | sed -n 's/.*State=\([^ ]*\).*/\1/p' || true)
    case "$state" in *DOWN* | *DRAIN* | *FAIL* | *NOT_RESPONDING*) [[ -n "${1:-}" ]] && echo "slurm_step: node $node is $state: not used" >&2 ;;
      *) healthy+=("$node") ;;
    esac
  done < <(scontrol show hostnames "$allocated")
}
find_healthy say
full=$nodes
if [[ ${#healthy[@]} -lt $nodes ]]; then
  nodes=${#healthy[@]}
  while [[ $nodes -gt 0 && $((full % nodes)) -ne 0 ]]; do nodes=$((nodes - 1)); done
  if [[ $nodes -eq 0 ]]; then
    echo "slurm_step: no healthy node left in the allocation; waiting for the supervisor's next restart" >&2
    exit 1
  fi
  echo "slurm_step: ${#healthy[@]} healthy node(s) of the $full needed and no spare left: continuing on $nodes with" \
       "the same global batch (run.full_processes=$((full * per_node))); back on $full once they are healthy" >&2
  set -- "$@" "run.full_processes=$((full * per_node))"
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
status=""
if [[ $nodes -lt $full ]]; then  # grow back: every few seconds, are all the nodes healthy again?
  while true; do
    sleep "${LLAMA_JAX_GROW_POLL_S:-30}" & poll=$!
    ended=""; wait -n -p ended "$step" "$poll"; code=$?  # the step's end, the poll's, or a signal (the trap ran)
    kill "$poll" 2>/dev/null
    if [[ "$ended" == "$step" ]]; then status=$code; break; fi
    find_healthy
    if [[ ${#healthy[@]} -ge $full ]]; then
      echo "slurm_step: $full healthy nodes again (${healthy[*]}): saving and restarting on all of them" >&2
      scancel --signal=TERM "$SLURM_JOB_ID"
      break
    fi
  done
fi
if [[ -z "$status" ]]; then
  wait "$step"; status=$?
  while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done
fi
exit "$status"
