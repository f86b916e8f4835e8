#!/usr/bin/env bash
# What the cluster launchers (slurm.sbatch, k8s.sh, multihost.sh) add to every training command, after the
# preset or config file and before the user's keys (a later key=value wins, so any of these can be overridden):
#   checkpoint.local_dir, checkpoint.local_every_steps=auto   the node-local tier, on storage each host has
#                                                              (LLAMA_JAX_LOCAL_DIR, default /dev/shm/llama-jax;
#                                                              empty: no local tier)
#   fault.preflight=true                                       the pre-flight check before the step compiles
#                                                              (LLAMA_JAX_PREFLIGHT=false: none)
# Usage: source launch/defaults.sh; train_args "$@"   (sets the array TRAIN_ARGS)
train_args() {
  TRAIN_ARGS=()
  if [[ $# -gt 0 && "$1" != *=* ]]; then TRAIN_ARGS+=("$1"); shift; fi  # PRESET or CONFIG.yaml comes first
  local dir="${LLAMA_JAX_LOCAL_DIR-/dev/shm/llama-jax}"
  if [[ -n "$dir" ]]; then TRAIN_ARGS+=("checkpoint.local_dir=$dir" "checkpoint.local_every_steps=auto"); fi
  if [[ "${LLAMA_JAX_PREFLIGHT:-true}" == true ]]; then TRAIN_ARGS+=("fault.preflight=true"); fi
  TRAIN_ARGS+=("$@")
}
