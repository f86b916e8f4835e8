#!/usr/bin/env bash
# The watch over a job's first node (launch/slurm.sbatch starts it as a job step of its own on the job's second
# node, sharing its resources: srun --overlap):
#
#   slurm_guard.sh FIRST_NODE LOG
#
# When the node that runs the batch script fails in a --no-kill job, Slurm removes it from the job and kills the
# batch script with it, but the job itself stays RUNNING on the other nodes with nothing left in it to restart the
# step (seen with Slurm 22.05: "Removing failed node n1 from JobId=3", the job running on n[2-3] until its time
# limit). So while the job runs, this looks at its node list every LLAMA_JAX_GUARD_POLL_S seconds (default 10); once
# FIRST_NODE is no longer in it (Slurm's own verdict; a node merely slow to answer stays in the job), it ends the
# job (scancel), which lets the successor job slurm.sbatch submitted (--dependency=afternotok) start and resume
# the run. It says so in LOG (the job's output file, appended), and ends with the job.
set -uo pipefail
first="$1" log="$2"

while true; do
  record=$(scontrol show job "$SLURM_JOB_ID" -o 2>/dev/null) || { sleep "${LLAMA_JAX_GUARD_POLL_S:-10}"; continue; }
  state=$(sed -n 's/.* JobState=\([^ ]*\).*/\1/p' <<<" $record")
  [[ "$state" == RUNNING || "$state" == SUSPENDED ]] || exit 0  # ended, requeued, or not a job at all
  nodes=$(sed -n 's/.* NodeList=\([^ ]*\).*/\1/p' <<<" $record")
  # The whole list read first: a reader that stops at the first match would leave scontrol a broken pipe.
  listed=$(scontrol show hostnames "$nodes" 2>/dev/null) || listed=""
  if [[ -n "$listed" && $'\n'"$listed"$'\n' != *$'\n'"$first"$'\n'* ]]; then
    echo "slurm_guard: the first node $first failed and took the batch script with it; ending job $SLURM_JOB_ID" \
         "so that its successor job takes over (it resumes from the newest checkpoint)" >>"$log"
    scancel "$SLURM_JOB_ID"
    exit 0
  fi
  sleep "${LLAMA_JAX_GUARD_POLL_S:-10}"
done
