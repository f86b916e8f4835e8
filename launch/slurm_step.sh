#!/usr/bin/env bash
# The job step launch/slurm.sbatch supervises: `srun ...` (the arguments), with a SIGTERM or SIGINT for it passed
# to the step's tasks through Slurm (scancel --signal, which leaves the batch script alone) instead of to srun: on
# SIGTERM srun forces the step's termination at once (the tasks are killed), and a preempted task must get the
# time to save its checkpoint and exit 75. srun runs in a process group of its own (set -m), so the signal the
# supervisor sends to this script's group reaches only this script.
set -m
"$@" &
step=$!
trap 'scancel --signal=TERM "$SLURM_JOB_ID"' TERM INT
wait "$step"; status=$?
while kill -0 "$step" 2>/dev/null; do wait "$step"; status=$?; done
exit "$status"
