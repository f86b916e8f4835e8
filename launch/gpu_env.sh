#!/usr/bin/env bash
# Recommended environment for llama-jax on NVIDIA GPUs, sourced by slurm.sbatch, k8s.sh and multihost.sh.
# Appends to XLA_FLAGS (a value you set is kept, and a later flag of the same name wins in XLA).
# The set is MaxText's for H100 (its GPU configs), in the names of jaxlib >= 0.11.1 (the `gpu` extra's floor:
# older jaxlibs abort on the xla_gpu_pipeline_* names). tests/test_launch.py checks every flag against the
# CUDA plugin's own flag list (tests/golden/xla_gpu_flags.json, read from jax-cuda13-pjrt 0.12.0, and the
# installed plugin where there is one) and refuses deprecated aliases.
llama_jax_gpu_flags=(
  --xla_gpu_enable_latency_hiding_scheduler=true        # schedule collectives to overlap with compute
  --xla_gpu_enable_highest_priority_async_stream=true   # collectives never wait behind compute kernels
  --xla_gpu_pipeline_all_gather=on                      # FSDP: gather layer i+1's weights during layer i
  --xla_gpu_pipeline_reduce_scatter=on                  # FSDP: scatter layer i's gradients during layer i-1
  --xla_gpu_pipeline_all_reduce=on                      # data parallelism: the same for all-reduced gradients
  --xla_gpu_enable_while_loop_double_buffering=true     # the same across iterations of the layer scan
  --xla_gpu_all_gather_combine_threshold_bytes=134217728      # fewer, larger collectives (128 MiB)
  --xla_gpu_reduce_scatter_combine_threshold_bytes=67108864   # 64 MiB: half, as MaxText, so two overlap
  --xla_gpu_all_reduce_combine_threshold_bytes=134217728
  --xla_gpu_enable_all_gather_combine_by_dim=false      # combine gathers of differently shaped weights too
  --xla_gpu_enable_reduce_scatter_combine_by_dim=false
  --xla_gpu_enable_triton_gemm=false                    # every matmul through cuBLAS: Triton GEMMs lose on LLM shapes
  --xla_gpu_enable_command_buffer=                      # no CUDA graphs: a step of few large kernels gains little, they hold memory
  --xla_disable_hlo_passes=rematerialization            # remat.policy alone decides what is recomputed (plan/tune price it)
)
# Not set: windowed einsum (collective matmuls, --xla_gpu_threshold_for_windowed_einsum_mib). With jaxlib 0.12.0.1
# XLA:GPU fails to compile llama3_70b's and llama3_405b's tensor-parallel steps with it ("Cannot infer shape for
# dot operation ... Contracting dimension sizes are not compatible"; `llama-jax plan ... --target h100`).
# XLA aborts on a flag it does not know, on any host: LLAMA_JAX_GPU_FLAGS=off leaves XLA_FLAGS alone (older jaxlib).
if [[ "${LLAMA_JAX_GPU_FLAGS:-on}" != off ]]; then
  export XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }${llama_jax_gpu_flags[*]}"
fi
# Let XLA preallocate 90% of each GPU (JAX's default: 75%); the rest is for cuDNN and NCCL workspaces.
export XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.90}"
# NCCL prints why a collective failed (a dead peer, a bad link) instead of failing silently.
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"

# Executed rather than sourced (bash launch/gpu_env.sh): print the settings as KEY=VALUE lines, for
# launchers that put them into another host's environment (k8s.sh, multihost.sh).
if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
  for key in XLA_FLAGS XLA_PYTHON_CLIENT_MEM_FRACTION NCCL_DEBUG; do printf '%s=%s\n' "$key" "${!key}"; done
fi
