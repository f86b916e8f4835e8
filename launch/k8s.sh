#!/usr/bin/env bash
# Train on Kubernetes: an Indexed Job (one pod per process, each pod its host's GPUs) and a headless
# Service that gives pod i the name NAME-i.NAME, so every pod finds the coordinator at NAME-0.NAME.
#
#   launch/k8s.sh --image IMAGE [--name NAME] [--processes N] [--gpus-per-pod G] [--port P]
#                 [--claim PVC] [--spares S] [--dry-run] [--] [PRESET|CONFIG.yaml] [key=value ...]
#
# Prints the manifest (--dry-run) or applies it with kubectl. IMAGE must have llama-jax installed
# (pip install 'llama-jax[gpu]'). The persistent volume claim PVC (default llama-jax-runs, a
# ReadWriteMany volume) is mounted at /runs in every pod: put run.dir there, e.g. run.dir=/runs/NAME.
# In each pod `llama-jax supervise` restarts a failed trainer; when one process dies the others stop
# (JAX's heartbeat), their supervisors restart them too and all resume from the newest checkpoint. A
# pod that exits 2 (bad input) fails the Job at once; any other pod failure gets a replacement pod.
# Every pod trains with the node-local checkpoint tier (/dev/shm, a memory-backed volume) and the pre-flight check
# on (launch/defaults.sh). Exit 71 (the pre-flight check named an unhealthy device; every pod exits 71) counts as
# a failure and the pods are replaced; before that, the supervisor in each pod labels the node(s) the check named
# llama-jax.io/unhealthy=true (the manifest's service account may patch nodes: a ClusterRole, which needs
# cluster-admin to apply once), and the pods' node affinity keeps the replacements off them. Without that
# permission the supervisor says so and prints the kubectl command to run.
# Hot spares: with --spares S (or LLAMA_JAX_SPARES) S placeholder pods, each holding a pod's GPUs on a node of its
# own, run at a priority below every other pod's (PriorityClass NAME-spare, -10, never preempting). A trainer pod
# replaced after a failure preempts one and starts on its node at once, instead of waiting for a free node (or
# the autoscaler); the placeholder then waits for the next free node, which is a spare again once one frees up.
set -euo pipefail

name=llama-jax
image=""
processes=2
gpus=8
port=1234
claim=llama-jax-runs
spares="${LLAMA_JAX_SPARES:-0}"
dry_run=0
while [[ $# -gt 0 ]]; do
  case "$1" in
    --name) name="${2:?}"; shift 2 ;;
    --image) image="${2:?}"; shift 2 ;;
    --processes) processes="${2:?}"; shift 2 ;;
    --gpus-per-pod) gpus="${2:?}"; shift 2 ;;
    --port) port="${2:?}"; shift 2 ;;
    --claim) claim="${2:?}"; shift 2 ;;
    --spares) spares="${2:?}"; shift 2 ;;
    --dry-run) dry_run=1; shift ;;
    -h|--help) sed -n '2,23p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    --) shift; break ;;
    *) break ;;
  esac
done
fail() { echo "k8s.sh: error: $*" >&2; exit 2; }
[[ -n "$image" ]] || fail "--image is required: an image with llama-jax installed"
[[ "$processes" =~ ^[1-9][0-9]*$ && "$gpus" =~ ^[0-9]+$ && "$port" =~ ^[1-9][0-9]*$ && "$spares" =~ ^[0-9]+$ ]] ||
  fail "--processes, --gpus-per-pod, --port and --spares must be integers"
[[ "$name" =~ ^[a-z0-9]([-a-z0-9]*[a-z0-9])?$ ]] || fail "--name must be a DNS label (lower case, digits, '-'), got '$name'"

json() {  # one JSON string (valid YAML) per argument
  local s="${1//\\/\\\\}"; s="${s//\"/\\\"}"; printf '"%s"' "$s"
}
source "$(dirname "${BASH_SOURCE[0]}")/defaults.sh"  # the local tier on /dev/shm and the pre-flight check
train_args "$@"
args=""
for a in llama-jax supervise -- llama-jax train "${TRAIN_ARGS[@]}"; do args+="${args:+, }$(json "$a")"; done
# The recommended GPU environment (gpu_env.sh, evaluated here) goes into the pod spec.
gpu_env=""
while IFS='=' read -r key value; do
  gpu_env+=$'\n'"        - name: $key"$'\n'"          value: $(json "$value")"
done < <(env -u XLA_FLAGS bash "$(dirname "${BASH_SOURCE[0]}")/gpu_env.sh")

# Where the pods may run (trainer and spare alike): not on a node labelled unhealthy after a pre-flight check named it.
affinity="affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
            - matchExpressions:
              - key: llama-jax.io/unhealthy
                operator: DoesNotExist"
manifest=$(cat <<EOF
apiVersion: v1
kind: ServiceAccount
metadata:
  name: $name
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: $name-label-unhealthy-nodes
rules:
- apiGroups: [""]
  resources: [nodes]
  verbs: [get, patch]  # the supervisor labels a node the pre-flight check named (llama_jax/resilience/cluster.py)
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: $name-label-unhealthy-nodes
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: $name-label-unhealthy-nodes
subjects:
- kind: ServiceAccount
  name: $name
  namespace: ${NAMESPACE:-default}
---
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
    - action: FailJob  # exit 2 is bad input, 74 failing checkpoint storage: a restart cannot fix either
      onExitCodes:
        containerName: trainer
        operator: In
        values: [2, 74]
    - action: Count  # exit 71, an unhealthy device: the pod fails and is replaced, off the node its supervisor labelled
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
      serviceAccountName: $name
      restartPolicy: Never
      $affinity
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
              fieldPath: spec.nodeName
        - name: LLAMA_JAX_LABEL_UNHEALTHY_NODES  # the supervisor labels the nodes the check names (cluster.py)
          value: "llama-jax.io/unhealthy=true"$gpu_env
        ports:
        - containerPort: $port
        resources:
          limits:
            nvidia.com/gpu: $gpus
        volumeMounts:
        - name: runs
          mountPath: /runs
        - name: shm  # the node-local checkpoint tier (and room for the loader), in the host's memory
          mountPath: /dev/shm
      volumes:
      - name: runs
        persistentVolumeClaim:
          claimName: $claim
      - name: shm
        emptyDir:
          medium: Memory
EOF
)
if [[ $spares -gt 0 ]]; then
  manifest+=$(cat <<EOF

---
apiVersion: scheduling.k8s.io/v1
kind: PriorityClass
metadata:
  name: $name-spare
value: -10  # below the default (0) of the trainer pods: the scheduler evicts a spare to place a trainer
preemptionPolicy: Never  # a spare never evicts anything itself
globalDefault: false
description: "llama-jax hot spares of job $name: placeholders that hold a node's GPUs until a trainer pod needs them"
---
apiVersion: apps/v1
kind: Deployment
metadata:
  name: $name-spare
spec:
  replicas: $spares
  selector:
    matchLabels:
      llama-jax.io/spare-of: $name
  template:
    metadata:
      labels:
        llama-jax.io/spare-of: $name
    spec:
      priorityClassName: $name-spare
      terminationGracePeriodSeconds: 0  # evicted at once: the trainer pod waits on it
      $affinity
      containers:
      - name: reserve
        image: registry.k8s.io/pause:3.10  # does nothing; holds the GPUs a trainer pod asks for
        resources:
          limits:
            nvidia.com/gpu: $gpus
EOF
)
fi
if [[ $dry_run -eq 1 ]]; then
  printf '%s\n' "$manifest"
  exit 0
fi
printf '%s\n' "$manifest" | kubectl apply -f -
