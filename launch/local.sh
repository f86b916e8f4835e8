#!/usr/bin/env bash
# Run llama-jax on this machine with N simulated CPU devices, to try a device mesh without GPUs.
#
#   launch/local.sh [--devices N] [--dry-run] [--] [train|plan] [PRESET|CONFIG] [key=value ...]
#
# The devices share this machine's cores (XLA's --xla_force_host_platform_device_count), so the
# numbers are the real sharded program's, not a speed-up. An existing XLA_FLAGS value is kept.
# Without a subcommand, `train` is run.
set -euo pipefail

devices=8
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices) devices="${2:?--devices needs a number}"; shift 2 ;;
    --devices=*) devices="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
if ! [[ "$devices" =~ ^[1-9][0-9]*$ ]]; then
  echo "launch/local.sh: error: --devices must be a positive integer, got '$devices'" >&2
  exit 2
fi
case "${1:-}" in
  train|plan) ;;
  *) set -- train "$@" ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
llama_jax="${LLAMA_JAX:-$here/.venv/bin/llama-jax}"
[[ -x "$llama_jax" ]] || llama_jax="llama-jax"  # installed elsewhere: use the one on PATH
xla_flags="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=$devices"

if [[ $dry_run -eq 1 ]]; then
  printf 'XLA_FLAGS=%q JAX_PLATFORMS=cpu %q' "$xla_flags" "$llama_jax"
  printf ' %q' "$@"
  printf '\n'
  exit 0
fi
XLA_FLAGS="$xla_flags" JAX_PLATFORMS=cpu exec "$llama_jax" "$@"
