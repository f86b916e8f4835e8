#!/usr/bin/env bash
# Run llama-jax on this machine with N simulated CPU devices, to try a device mesh without GPUs,
# and with --processes P as a multi-host run: P processes of N devices each (launch/multiprocess.py).
#
#   launch/local.sh [--devices N] [--processes P] [--dry-run] [--] [train|plan|doctor] [PRESET|CONFIG] [key=value ...]
#
# The devices share this machine's cores (XLA's --xla_force_host_platform_device_count), so the
# numbers are the real sharded program's, not a speed-up. An existing XLA_FLAGS value is kept.
# Without a subcommand, `train` is run.
set -euo pipefail

devices=8
processes=1
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --devices) devices="${2:?--devices needs a number}"; shift 2 ;;
    --devices=*) devices="${1#*=}"; shift ;;
    --processes) processes="${2:?--processes needs a number}"; shift 2 ;;
    --processes=*) processes="${1#*=}"; shift ;;
    --dry-run) dry_run=1; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) break ;;
  esac
done
for option in devices processes; do
  if ! [[ "${!option}" =~ ^[1-9][0-9]*$ ]]; then
    echo "launch/local.sh: error: --$option must be a positive integer, got '${!option}'" >&2
    exit 2
  fi
done
case "${1:-}" in
  train|plan|doctor) ;;
  *) set -- train "$@" ;;
esac

here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ "$processes" -gt 1 ]]; then
  python="$here/.venv/bin/python"
  [[ -x "$python" ]] || python=python3
  exec "$python" "$here/launch/multiprocess.py" --processes "$processes" --devices "$devices" \
    $([[ $dry_run -eq 1 ]] && echo --dry-run) -- "$@"
fi
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
