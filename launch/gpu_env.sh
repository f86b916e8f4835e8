#!/usr/bin/env bash
# Recommended environment for llama-jax on NVIDIA GPUs, sourced by slurm.sbatch, k8s.sh and multihost.sh.
# Appends to XLA_FLAGS (a value you set is kept, and a later flag of the same name wins in XLA).
# Every flag here is checked against the installed jaxlib by tests/test_launch.py.
llama_jax_gpu_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true        # schedule collectives to overlap with compute
  --xla_gpu_enable_highest_priority_async_stream=true   # collectives never wait behind compute kernels
  --xla_gpu_enable_pipelined_all_gather=true            # FSDP: gather layer i+1's weights during layer i
  --xla_gpu_enable_pipelined_reduce_scatter=true        # FSDP: scatter layer i's gradients during layer i-1
  --xla_gpu_enable_pipelined_all_reduce=true
  --xla_gpu_enable_while_loop_double_buffering=true     # the same across iterations of the layer scan
  --xla_gpu_all_gather_combine_threshold_bytes=134217728      # fewer, larger collectives (128 MiB)
  --xla_gpu_reduce_scatter_combine_threshold_bytes=134217728
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
)
export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }${llama_jax_gpu_flags[*]}"
# Let XLA preallocate 90% of each GPU (JAX's default: 75%); the rest is for cuDNN and NCCL workspaces.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
# NCCL prints why a collective failed (a dead peer, a bad link) instead of failing silently.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# Executed rather than sourced (bash launch/gpu_env.sh): print the settings as KEY=VALUE lines, for
# launchers that put them into another host's environment (k8s.sh, multihost.sh).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  for key in XLA_FLAGS XLA_PYTHON_CLIENT_MEM_FRACTION NCCL_DEBUG; do printf '%s=%s\n' "$key" "${!key}"; done
fi
