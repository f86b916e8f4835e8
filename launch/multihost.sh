#!/usr/bin/env bash
# Train on plain hosts (no scheduler): the same command on every host, each with its process id.
#
#   launch/multihost.sh --hosts HOST0,HOST1,... [--port P] [--ssh CMD] [--dry-run] [--] [PRESET|CONFIG] [key=value ...]
#       starts process i on HOST_i over ssh (one process per host, driving all of its GPUs)
#   launch/multihost.sh --coordinator HOST0:P --processes N --process-id I [--] [PRESET|CONFIG] [key=value ...]
#       runs process I here: type it on every host yourself (or with pdsh / clush)
#
# HOST0 hosts the coordinator, on port P (default 1234). Every process runs under `llama-jax supervise`:
# when one dies, the others stop (JAX's heartbeat), every supervisor restarts its process and they
# meet again at the coordinator, resuming from the newest checkpoint. run.dir must be on a filesystem
# all hosts share. The remote command runs in this directory (the same path on every host) with
# LLAMA_JAX (default: llama-jax on PATH), with the node-local checkpoint tier and the pre-flight check on
# (launch/defaults.sh). --ssh replaces `ssh` (e.g. "ssh -i key"); --dry-run prints the command of every host.
set -euo pipefail

hosts=""
port=1234
ssh_command="ssh"
coordinator=""
processes=""
process_id=""
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --hosts) hosts="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --ssh) ssh_command="${2:?}"; shift 2 ;;
    --coordinator) coordinator="${2:?}"; shift 2 ;;
    --processes) processes="${2:?}"; shift 2 ;;
    --process-id) process_id="${2:?}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
fail() { echo "multihost.sh: error: $*" >&2; exit 2; }

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
llama_jax="${LLAMA_JAX:-llama-jax}"
source "$here/defaults.sh"  # the local tier on /dev/shm and the pre-flight check, before the user's keys
train_args "$@"
set -- "${TRAIN_ARGS[@]}"

# The recommended GPU environment (gpu_env.sh; its XLA flags need jaxlib >= 0.11.1 on every host), as env arguments.
gpu_env=()
while IFS= read -r setting; do gpu_env+=("$setting"); done < <(bash "$here/gpu_env.sh")

# The shell command of one process, with its place in the run given explicitly.
run_one() {  # COORDINATOR PROCESSES ID ARGS...
  printf 'cd %q && exec env' "$PWD"
  printf ' %q' "${gpu_env[@]}" "JAX_COORDINATOR_ADDRESS=$1" "JAX_NUM_PROCESSES=$2" "JAX_PROCESS_ID=$3"
  shift 3
  printf ' %q' "$llama_jax" supervise -- "$llama_jax" train "$@"
}

if [[ -z "$hosts" ]]; then
  [[ -n "$coordinator" && -n "$processes" && -n "$process_id" ]] ||
    fail "give --hosts H0,H1,... or all of --coordinator HOST:PORT, --processes N and --process-id I"
  [[ "$processes" =~ ^[1-9][0-9]*$ && "$process_id" =~ ^[0-9]+$ && "$process_id" -lt "$processes" ]] ||
    fail "--process-id must be in [0, --processes)"
  line="$(run_one "$coordinator" "$processes" "$process_id" "$@")"
  if [[ $dry_run -eq 1 ]]; then echo "$line"; exit 0; fi
  exec bash -c "$line"
fi

IFS=, read -r -a host_list <<< "$hosts"
[[ ${#host_list[@]} -ge 1 ]] || fail "--hosts is empty"
[[ "$port" =~ ^[1-9][0-9]*$ ]] || fail "--port must be a number, got '$port'"
coordinator="${host_list[0]}:$port"
n=${#host_list[@]}
read -r -a ssh_words <<< "$ssh_command"
if [[ $dry_run -eq 1 ]]; then
  echo "# $n processes, one per host; coordinator $coordinator"
fi
pids=()
for i in "${!host_list[@]}"; do
  line="$(run_one "$coordinator" "$n" "$i" "$@")"
  if [[ $dry_run -eq 1 ]]; then
    printf '%s %q %q\n' "$ssh_command" "${host_list[i]}" "$line"
    continue
  fi
  "${ssh_words[@]}" "${host_list[i]}" "$line" &
  pids+=($!)
done
[[ $dry_run -eq 1 ]] && exit 0
trap 'kill -TERM "${pids[@]}" 2>/dev/null' TERM INT
status=0
for pid in "${pids[@]}"; do
  wait "$pid" || { s=$?; [[ $status -eq 0 ]] && status=$s; }
done
exit "$status"
