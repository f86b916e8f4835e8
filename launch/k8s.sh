#!/usr/bin/env bash
# Train on Kubernetes: an Indexed Job (one pod per process, each pod its host's GPUs) and a headless
# Service that gives pod i the name NAME-i.NAME, so every pod finds the coordinator at NAME-0.NAME.
#
#   launch/k8s.sh --image IMAGE [--name NAME] [--processes N] [--gpus-per-pod G] [--port P]
#                 [--claim PVC] [--dry-run] [--] [PRESET|CONFIG.yaml] [key=value ...]
#
# Prints the manifest (--dry-run) or applies it with kubectl. IMAGE must have llama-jax installed
# (pip install 'llama-jax[gpu]'). The persistent volume claim PVC (default llama-jax-runs, a
# ReadWriteMany volume) is mounted at /runs in every pod: put run.dir there, e.g. run.dir=/runs/NAME.
# In each pod `llama-jax supervise` restarts a failed trainer; when one process dies the others stop
# (JAX's heartbeat), their supervisors restart them too and all resume from the newest checkpoint. A
# pod that exits 2 (bad input) fails the Job at once; any other pod failure gets a replacement pod.
# Exit 71 (fault.preflight=true named an unhealthy device; every pod exits 71) counts as a failure and the
# pods are replaced, but the scheduler may put one on the same node again: label the node the log and
# run.dir/unhealthy.json name (LLAMA_JAX_NODE_NAME below makes the check report the node, not the pod),
#   kubectl label node NODE llama-jax.io/unhealthy=true
# and the pods' node affinity keeps them off it (a taint keeps every workload off it:
# kubectl taint nodes NODE llama-jax.io/unhealthy=true:NoSchedule; node-problem-detector can do either).
set -euo pipefail

name=llama-jax
image=""
processes=2
gpus=8
port=1234
claim=llama-jax-runs
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="${2:?}"; shift 2 ;;
    --image) image="${2:?}"; shift 2 ;;
    --processes) processes="${2:?}"; shift 2 ;;
    --gpus-per-pod) gpus="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --claim) claim="${2:?}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
fail() { echo "k8s.sh: error: $*" >&2; exit 2; }
[[ -n "$image" ]] || fail "--image is required: an image with llama-jax installed"
[[ "$processes" =~ ^[1-9][0-9]*$ && "$gpus" =~ ^[0-9]+$ && "$port" =~ ^[1-9][0-9]*$ ]] ||
  fail "--processes, --gpus-per-pod and --port must be integers"
[[ "$name" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || fail "--name must be a DNS label (lower case, digits, '-'), got '$name'"

json() {  # one JSON string (valid YAML) per argument
  local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '"%s"' "$s"
}
args=""
for a in llama-jax supervise -- llama-jax train "$@"; do args+="${args:+, }$(json "$a")"; done
# The recommended GPU environment (gpu_env.sh, evaluated here) goes into the pod spec.
gpu_env=""
while IFS='=' read -r key value; do
  gpu_env+=$'\n'"        - name: $key"$'\n'"          value: $(json "$value")"
done < <(env -u XLA_FLAGS bash "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh")

manifest=$(cat <<EOF
apiVersion: v1
kind: Service
metadata:
  name: $name
spec:
  clusterIP: None  # headless: DNS names for the pods, no load balancing
  selector:
    job-name: $name
  ports:
  - name: coordinator
    port: $port
---
apiVersion: batch/v1
kind: Job
metadata:
  name: $name
spec:
  completionMode: Indexed
  completions: $processes
  parallelism: $processes
  backoffLimit: 20
  podFailurePolicy:
    rules:
    - action: FailJob  # exit 2 is bad input: a restart cannot fix it
      onExitCodes:
        containerName: trainer
        operator: In
        values: [2]
    - action: Count  # exit 71, an unhealthy device: the pod fails and is replaced (off a labelled node)
      onExitCodes:
        containerName: trainer
        operator: In
        values: [71]
  template:
    metadata:
      labels:
        job-name: $name
    spec:
      subdomain: $name
      restartPolicy: Never
      affinity:  # not on a node labelled unhealthy after a pre-flight check named it (see the top of launch/k8s.sh)
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions:
              - key: llama-jax.io/unhealthy
                operator: DoesNotExist
      containers:
      - name: trainer
        image: $(json "$image")
        command: [$args]
        env:
        - name: JAX_COORDINATOR_ADDRESS
          value: "$name-0.$name:$port"
        - name: JAX_NUM_PROCESSES
          value: "$processes"
        - name: JAX_PROCESS_ID
          valueFrom:
            fieldRef:
              fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
        - name: LLAMA_JAX_NODE_NAME  # the pre-flight check names the node, which can be labelled, not the pod
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName$gpu_env
        ports:
        - containerPort: $port
        resources:
          limits:
            nvidia.com/gpu: $gpus
        volumeMounts:
        - name: runs
          mountPath: /runs
      volumes:
      - name: runs
        persistentVolumeClaim:
          claimName: $claim
EOF
)
if [[ $dry_run -eq 1 ]]; then
  printf '%s\n' "$manifest"
  exit 0
fi
printf '%s\n' "$manifest" | kubectl apply -f -
