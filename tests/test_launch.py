"""launch/ scripts: each is exercised (dry-run output checked, and the local launcher really run)."""

import importlib
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import jaxlib
import pytest
from test_readme import readme_commands

from llama_jax.planning.goodput_projection import LAUNCHER_KEYS

ROOT = Path(__file__).resolve().parents[1]
LOCAL = ROOT / "launch" / "local.sh"


def local(*args, env_extra=None):
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | (env_extra or {})
    env["LLAMA_JAX"] = str(Path(sys.executable).parent / "llama-jax")
    return subprocess.run([str(LOCAL), *args], capture_output=True, text=True, env=env, cwd=ROOT)


def test_dry_run_prints_the_exact_command():
    result = local("--devices", "4", "--dry-run", "tiny", "mesh.data=2", "run.dir=runs/a b")
    assert result.returncode == 0
    words = shlex.split(result.stdout)
    assert words[:2] == ["XLA_FLAGS=--xla_force_host_platform_device_count=4", "JAX_PLATFORMS=cpu"]
    assert words[2].endswith("llama-jax") and words[3:] == ["train", "tiny", "mesh.data=2", "run.dir=runs/a b"]


def test_existing_xla_flags_are_kept():
    result = local("--dry-run", "plan", "bench", env_extra={"XLA_FLAGS": "--xla_dump_to=/tmp/x"})
    assert "XLA_FLAGS=--xla_dump_to=/tmp/x\\ --xla_force_host_platform_device_count=8" in result.stdout
    assert " plan bench" in result.stdout


def test_bad_device_count_exits_2():
    result = local("--devices", "0", "tiny")
    assert result.returncode == 2 and "--devices must be a positive integer" in result.stderr


def test_local_launcher_really_runs_on_simulated_devices():
    result = local("--devices", "2", "plan", "tiny", "model.n_layers=1", "mesh.fsdp=2", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["devices"] == 2


def test_readme_local_commands_dry_run():
    commands = readme_commands("launch/local.sh")
    assert commands
    for command in commands:
        args = shlex.split(command)[1:]
        result = local("--dry-run", *args)
        assert result.returncode == 0 and ("llama-jax train" in result.stdout or "llama-jax doctor" in result.stdout)


# --------------------------------------------------------------------------------------------
# Multi-process and cluster launchers. The cluster scripts really run here, with stand-ins for the
# commands a cluster provides (srun, scontrol, ssh) and for llama-jax (it prints what it was given).

FAKE_LLAMA_JAX = """#!/usr/bin/env python3
import json, os, sys
args = sys.argv[1:]
if args[0] == "supervise":  # run the supervised command, as the real supervisor would
    command = args[args.index("--") + 1:]
    os.execvp(command[0], command)
keys = ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS")
# One write: processes on the fake hosts share stdout, and print() may write the newline separately.
os.write(1, (json.dumps({"args": args, **{k: os.environ.get(k) for k in keys}}) + "\\n").encode())
"""
FAKE_SRUN = """#!/usr/bin/env bash
# srun --kill-on-bad-exit=1 --nodes=N --nodelist=A,B --ntasks-per-node=P CMD...: run the N x P tasks here, one
# after another, as Slurm numbers them
while [[ "$1" == --* ]]; do
  case "$1" in --nodes=*) nodes="${1#--nodes=}" ;; --ntasks-per-node=*) per_node="${1#--ntasks-per-node=}" ;; esac
  shift
done
export SLURM_NTASKS=$((nodes * per_node))
for ((p = 0; p < SLURM_NTASKS; p++)); do SLURM_PROCID=$p SLURM_LOCALID=$((p % per_node)) "$@"; done
"""
FAKE_SCONTROL = """#!/usr/bin/env bash
[[ "$1 $2" == "show hostnames" ]] && printf 'gpu17\\ngpu18\\n'
[[ "$1 $2" == "show node" ]] && echo "NodeName=$3 NodeAddr=$3 State=IDLE"
exit 0
"""
# A job's own submissions (slurm.sbatch submits its successor at its start): a job id, nothing queued, no-op cancel.
FAKE_SBATCH = "#!/usr/bin/env bash\necho 4243\n"
FAKE_SQUEUE = FAKE_SCANCEL = "#!/usr/bin/env bash\nexit 0\n"
FAKE_SSH = """#!/usr/bin/env bash
# ssh HOST COMMAND: run COMMAND here
shift
exec bash -c "$1"
"""


def fakes(tmp_path):
    """A bin directory with the stand-ins; returns the environment that puts it first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {
        "llama-jax": FAKE_LLAMA_JAX,
        "srun": FAKE_SRUN,
        "scontrol": FAKE_SCONTROL,
        "sbatch": FAKE_SBATCH,
        "squeue": FAKE_SQUEUE,
        "scancel": FAKE_SCANCEL,
        "ssh": FAKE_SSH,
    }.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"PATH": f"{bin_dir}:{env['PATH']}", "LLAMA_JAX": str(bin_dir / "llama-jax")}


def processes_of(stdout: str) -> list[dict]:
    return sorted(
        (json.loads(line) for line in stdout.splitlines() if line.startswith("{")),
        key=lambda p: int(p["JAX_PROCESS_ID"]),
    )


def test_local_launcher_with_processes_dry_run():
    result = local("--processes", "2", "--devices", "4", "--dry-run", "tiny", "run.dir=runs/mh")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert len(lines) == 2
    for i, line in enumerate(lines):
        words = shlex.split(line)
        assert words[:5] == [
            "XLA_FLAGS=--xla_force_host_platform_device_count=4",
            "JAX_PLATFORMS=cpu",
            words[2],
            "JAX_NUM_PROCESSES=2",
            f"JAX_PROCESS_ID={i}",
        ]
        assert words[2].startswith("JAX_COORDINATOR_ADDRESS=127.0.0.1:")
        assert words[-3:] == ["train", "tiny", "run.dir=runs/mh"]
    assert shlex.split(lines[0])[2] == shlex.split(lines[1])[2]  # one coordinator


# What the cluster launchers add after the preset, before the user's keys (launch/defaults.sh): the node-local
# checkpoint tier on /dev/shm and the pre-flight check. `llama-jax goodput` projects a launched run with the same
# keys, from its own copy: every launcher test below checks the scripts add exactly that copy.
LAUNCHER_DEFAULTS = list(LAUNCHER_KEYS)


def test_launchers_put_the_local_tier_on_node_local_storage_and_run_the_pre_flight_check_by_default():
    """Every cluster launcher trains with the defaults after the preset (the user's later keys win); empty
    LLAMA_JAX_LOCAL_DIR and LLAMA_JAX_PREFLIGHT=false leave them out."""

    def dry(script, *args, env=None):
        return subprocess.run(
            ["bash", str(ROOT / "launch" / script), *args],
            capture_output=True,
            text=True,
            env={**os.environ, "LLAMA_JAX": "llama-jax", **(env or {})},
            check=True,
        ).stdout

    slurm = dry(
        "slurm.sbatch",
        "--dry-run",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "llama3_8b",
        "run.dir=/r",
        "checkpoint.local_every_steps=50",
    )
    assert slurm.splitlines()[-1].endswith(
        "train llama3_8b " + " ".join(LAUNCHER_DEFAULTS) + " run.dir=/r checkpoint.local_every_steps=50"
    )
    hosts = dry("multihost.sh", "--dry-run", "--hosts", "a", "--", "tiny", "run.dir=/r")
    assert " ".join(LAUNCHER_DEFAULTS) in shlex.split(hosts.splitlines()[-1])[2]
    bare = dry(
        "slurm.sbatch",
        "--dry-run",
        "--nodes",
        "1",
        "--gpus-per-node",
        "1",
        "tiny",
        env={"LLAMA_JAX_LOCAL_DIR": "", "LLAMA_JAX_PREFLIGHT": "false"},
    )
    assert bare.splitlines()[-1].endswith("train tiny")


def test_slurm_dry_run_names_every_process():
    result = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "slurm.sbatch"),
            "--dry-run",
            "--nodes",
            "3",
            "--gpus-per-node",
            "4",
            "llama3_8b",
            "run.dir=/shared/8b",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "LLAMA_JAX": "llama-jax"},
    )
    assert result.returncode == 0, result.stderr
    header, supervised, *tasks = result.stdout.splitlines()
    assert header == "# 3 node(s) x 4 process(es) = 12 processes; coordinator node0:20000"
    assert supervised.startswith("llama-jax supervise ")  # 3 nodes of 4 processes, the port: slurm_step.sh runs srun
    assert "/launch/slurm_step.sh 3 4 20000 llama-jax train llama3_8b " in supervised
    assert len(tasks) == 12
    for p, task in enumerate(tasks):
        assert task.startswith(
            f"node{p // 4}: JAX_COORDINATOR_ADDRESS=node0:20000 JAX_NUM_PROCESSES=12 "
            f"JAX_PROCESS_ID={p} JAX_LOCAL_DEVICE_IDS={p % 4} llama-jax train llama3_8b " + " ".join(LAUNCHER_DEFAULTS)
        )


def test_slurm_script_gives_each_task_its_place(tmp_path):
    """The batch script as Slurm runs it: 2 nodes x 2 tasks, job 4242 on gpu17 and gpu18."""
    env = fakes(tmp_path) | {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[17-18]",
        "SLURM_SUBMIT_DIR": str(ROOT),
    }
    result = subprocess.run(
        ["bash", str(ROOT / "launch" / "slurm.sbatch"), "tiny", "run.dir=/shared/t"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    tasks = processes_of(result.stdout)
    assert [t["JAX_PROCESS_ID"] for t in tasks] == ["0", "1", "2", "3"]
    assert {t["JAX_COORDINATOR_ADDRESS"] for t in tasks} == {f"gpu17:{20000 + 4242}"}
    assert {t["JAX_NUM_PROCESSES"] for t in tasks} == {"4"}
    assert [t["JAX_LOCAL_DEVICE_IDS"] for t in tasks] == ["0", "1", "0", "1"]
    assert all(t["args"] == ["train", "tiny", *LAUNCHER_DEFAULTS, "run.dir=/shared/t"] for t in tasks)
    assert all("--xla_gpu_enable_latency_hiding_scheduler=true" in t["XLA_FLAGS"] for t in tasks)


# The trainer as the pre-flight check ends it on every process: the verdict in run.dir, exit 71.
UNHEALTHY_LLAMA_JAX = """#!/usr/bin/env python3
import json, os, sys
from pathlib import Path
args = sys.argv[1:]
if args[0] == "supervise":
    command = args[args.index("--") + 1:]
    os.execvp(command[0], command)
run_dir = Path([a for a in args if a.startswith("run.dir=")][-1].split("=", 1)[1])
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / "unhealthy.json").write_text(json.dumps({"exit_code": 71, "hosts": ["gpu18"], "devices": []}))
sys.exit(71)
"""


def slurm_script_in_a_job(tmp_path, job: dict, stand_ins: dict[str, str], *args: str):
    """launch/slurm.sbatch run as Slurm runs job 4242 (`job`: its other SLURM_* variables), with fakes()' stand-ins,
    `stand_ins` (name -> script) in place of some, and an sbatch (answering job 4243) and scancel that record their
    calls in tmp_path/calls (as a stand-in given may). (the finished script, the calls file)."""
    env = fakes(tmp_path) | {"SLURM_JOB_ID": "4242", "SLURM_SUBMIT_DIR": str(ROOT), **job}
    bin_dir, calls = tmp_path / "bin", tmp_path / "calls"
    queue = (
        tmp_path / "queue"
    )  # what squeue shows: the successor sbatch submitted (held by afternotok), until cancelled
    recorders = {
        "sbatch": f'#!/usr/bin/env bash\necho "sbatch $*" >> {calls}\n'
        f'[[ "$*" =~ afternotok:([0-9]+) ]] && echo "4243 afternotok:${{BASH_REMATCH[1]}}(unfulfilled)" >> {queue}\n'
        "echo 4243\n",
        "scancel": f'#!/usr/bin/env bash\necho "scancel $*" >> {calls}\nrm -f {queue}\n',
        "squeue": f"#!/usr/bin/env bash\ncat {queue} 2>/dev/null\nexit 0\n",
    }
    for name, text in {**recorders, **stand_ins}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    script = ROOT / "launch" / "slurm.sbatch"
    result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=env, timeout=60)
    return result, calls


def test_slurm_script_resubmits_without_the_unhealthy_node(tmp_path):
    """Exit 71 (the pre-flight check named a device on gpu18): the script is submitted again with gpu18 excluded,
    beside the node the job already excluded, on as many nodes, with the same arguments."""
    job = {
        "SLURM_JOB_NUM_NODES": "2",
        "SLURM_NTASKS_PER_NODE": "2(x2)",
        "SLURM_NTASKS": "4",
        "SLURM_JOB_NODELIST": "gpu[17-18]",
        "SLURM_JOB_PARTITION": "gpu",
    }
    scontrol = (
        '#!/usr/bin/env bash\necho "scontrol $*" >> ' + str(tmp_path / "calls") + "\n"
        '[[ "$1 $2" == "show hostnames" ]] && printf "gpu17\\ngpu18\\n"\n'
        '[[ "$1 $2" == "show job" ]] && echo "   ReqNodeList=(null) ExcNodeList=gpu3"\n'
        "exit 0\n"
    )
    run_dir, script = tmp_path / "run", ROOT / "launch" / "slurm.sbatch"
    stand_ins = {"llama-jax": UNHEALTHY_LLAMA_JAX, "scontrol": scontrol}
    result, calls = slurm_script_in_a_job(
        tmp_path, job, stand_ins, "tiny", f"run.dir={run_dir}", "fault.preflight=true"
    )
    assert result.returncode == 71, result.stderr
    assert "unhealthy node(s) gpu3,gpu18" in result.stderr
    submitted = [line for line in calls.read_text().splitlines() if line.startswith(("sbatch", "scancel"))]
    same = "--ntasks-per-node 2 --gpus-per-node 0 --partition gpu"
    arguments = f"{script} tiny run.dir={run_dir} fault.preflight=true"
    assert submitted == [
        f"sbatch --parsable {same} --exclude gpu3 --nodes 2-2 --dependency afternotok:4242 "
        f"--export ALL,LLAMA_JAX_ACTIVE_NODES=2 {arguments}",  # its successor, at its start, as the job excludes
        "scancel 4243",  # which the job submitted again in its place makes its own
        f"sbatch --nodes 2 --exclude gpu3,gpu18 {same} {arguments}",
    ]
    assert "requeue" not in calls.read_text()


def test_slurm_script_submits_its_successor_first_and_cancels_it_at_its_own_end(tmp_path):
    """Every job submits at its start the job that takes over should its first node fail (afternotok, the nodes it
    trains on up to all it holds, its tasks and GPUs per node, name, partition, time and log), and cancels it when
    the script itself ends. A requeued job finds its waiting successor instead of submitting another; a successor
    trains on its predecessor's node count (LLAMA_JAX_ACTIVE_NODES), the rest of its nodes spares."""
    scontrol = (
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu17\\ngpu18\\ngpu19\\n"\n'
        '[[ "$1 $2" == "show node" ]] && echo "NodeName=$3 NodeAddr=$3 State=ALLOCATED"\n'
        '[[ "$1 $2" == "show job" ]] && echo "JobId=4242 JobName=big TimeLimit=2-00:00:00 QOS=(null) '
        'TresPerNode=gres:gpu:8 StdOut=/shared/logs/slurm-4242.out"\nexit 0\n'
    )
    srun = FAKE_SRUN.replace("while [[", f'echo "srun $*" >> {tmp_path / "calls"}\nwhile [[', 1)
    job = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "gpu[17-19]"}
    job |= {"SLURM_JOB_NAME": "big", "SLURM_JOB_PARTITION": "gpu"}
    script = ROOT / "launch" / "slurm.sbatch"
    result, calls = slurm_script_in_a_job(
        tmp_path, job, {"scontrol": scontrol, "srun": srun}, "--spares", "1", "tiny", "run.dir=/shared/t"
    )
    assert result.returncode == 0, result.stderr
    assert "slurm.sbatch: job 4243 waits to take over should this job's first node fail" in result.stderr
    lines = calls.read_text().splitlines()
    assert lines[0] == (
        "sbatch --parsable --ntasks-per-node 1 --gpus-per-node 8 --job-name big --partition gpu --time 2-00:00:00 "
        "--output /shared/logs/slurm-4242.out --no-kill --nodes 2-3 --dependency afternotok:4242 "
        f"--export ALL,LLAMA_JAX_ACTIVE_NODES=2 {script} --spares 1 tiny run.dir=/shared/t"
    )
    assert [line for line in lines if "--nodelist=gpu17,gpu18 " in line]  # trained
    assert lines[-1] == "scancel 4243"  # then cancelled it

    # The same job requeued: its successor still waits (squeue), so it submits none and cancels that one.
    squeue = '#!/usr/bin/env bash\necho "4250 afternotok:4241(unfulfilled)"\necho "4251 afternotok:4242(unfulfilled)"\n'
    (tmp_path / "calls").unlink()
    for case in ("requeued", "successor", "bad"):
        (tmp_path / case).mkdir()
    requeued, calls = slurm_script_in_a_job(
        tmp_path / "requeued", job, {"scontrol": scontrol, "srun": srun, "squeue": squeue}, "--spares", "1", "tiny"
    )
    assert requeued.returncode == 0, requeued.stderr
    assert "slurm.sbatch: job 4251 waits to take over" in requeued.stderr
    assert [line for line in calls.read_text().splitlines() if not line.startswith("srun")] == ["scancel 4251"]

    # The successor, given 3 nodes where its predecessor trained on 2: 2 train, 1 is its spare.
    successor = job | {"LLAMA_JAX_ACTIVE_NODES": "2", "SLURM_JOB_ID": "4243"}
    ran, calls = slurm_script_in_a_job(tmp_path / "successor", successor, {"scontrol": scontrol, "srun": srun}, "tiny")
    assert ran.returncode == 0, ran.stderr
    assert "slurm_step: on gpu17 gpu18; spare(s): gpu19" in ran.stderr
    assert "--no-kill --nodes 2-3 --dependency afternotok:4243 " in calls.read_text()

    # The watch itself (slurm_guard.sh): left alone while the first node is in the job, however long its list;
    # the job ended by it once Slurm removed the first node; gone quietly once the job is not running.
    guard = ROOT / "launch" / "slurm_guard.sh"
    for case, nodes, state, ends in (
        ("kept", "n[1-6000]", "RUNNING", False),
        ("lost", "n[2-6000]", "RUNNING", True),
        ("over", "n[1-2]", "COMPLETED", False),
    ):
        here = tmp_path / f"guard-{case}"
        here.mkdir()
        env = fakes(here) | {"SLURM_JOB_ID": "77", "LLAMA_JAX_GUARD_POLL_S": "0.05"}
        polls = here / "polls"
        (here / "bin" / "scontrol").write_text(
            "#!/usr/bin/env bash\n"
            f'if [[ "$1 $2" == "show hostnames" ]]; then first=${{3#n[}}; first=${{first%%-*}}\n'
            '  for ((i = first; i <= 6000; i++)); do echo "n$i"; done; exit 0; fi\n'
            f"echo . >> {polls}\n"  # the third poll finds the job ended
            f'[[ $(wc -l < {polls}) -ge 3 ]] && echo "JobId=77 JobState=COMPLETED NodeList={nodes}" && exit 0\n'
            f'echo "JobId=77 JobState={state} NodeList={nodes}"\n'
        )
        (here / "bin" / "scancel").write_text(f'#!/usr/bin/env bash\necho "scancel $*" >> {here / "calls"}\n')
        watched = subprocess.run(
            ["bash", str(guard), "n1", str(here / "log")], capture_output=True, text=True, env=env, timeout=60
        )
        assert watched.returncode == 0, watched.stderr
        assert (here / "calls").exists() == ends, case
        if ends:
            assert (here / "calls").read_text() == "scancel 77\n"
            assert (here / "log").read_text().startswith("slurm_guard: the first node n1 failed and took the batch")

    # A predecessor's count this job cannot hold: one line, exit 2, nothing submitted.
    bad, calls = slurm_script_in_a_job(tmp_path / "bad", job | {"LLAMA_JAX_ACTIVE_NODES": "5"}, {}, "tiny")
    assert bad.returncode == 2 and not calls.exists()
    assert bad.stderr.strip().splitlines() == [
        "slurm.sbatch: error: LLAMA_JAX_ACTIVE_NODES=5 must be a node count of at most this job's 3; unset it (a "
        "successor job is given it by its predecessor)"
    ]


def test_slurm_script_puts_a_spare_in_the_place_of_an_unhealthy_node_inside_the_allocation(tmp_path):
    """sbatch --nodes 3 ... --spares 1: the pre-flight check names gpu18 (exit 71); the step starts again inside
    the allocation on gpu17 and the spare gpu19, with no new submission, and the run goes on (exit 0)."""
    job = {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "1", "SLURM_JOB_NODELIST": "gpu[17-19]"}
    # The check fails while gpu18 is in the step (slurm.sbatch hands slurm_step.sh the nodes it leaves out).
    unhealthy_while_gpu18_runs = UNHEALTHY_LLAMA_JAX.replace(
        "run_dir = Path", 'if "gpu18" in os.environ["LLAMA_JAX_EXCLUDE_NODES"]:\n    sys.exit(0)\nrun_dir = Path'
    )
    scontrol = (
        '#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] && printf "gpu17\\ngpu18\\ngpu19\\n"\n'
        '[[ "$1 $2" == "show node" ]] && echo "NodeName=$3 NodeAddr=$3 State=ALLOCATED"\nexit 0\n'
    )
    srun = FAKE_SRUN.replace("while [[", f'echo "srun $*" >> {tmp_path / "calls"}\nwhile [[', 1)  # each step's nodes
    stand_ins = {"llama-jax": unhealthy_while_gpu18_runs, "scontrol": scontrol, "srun": srun}
    run_dir = tmp_path / "run"
    result, calls = slurm_script_in_a_job(tmp_path, job, stand_ins, "--spares", "1", "tiny", f"run.dir={run_dir}")
    assert result.returncode == 0, result.stderr
    assert "unhealthy node(s) gpu18: starting again on the allocation's other nodes" in result.stderr
    assert "slurm_step: node gpu18 was named by the pre-flight check: not used" in result.stderr
    srun = [line for line in calls.read_text().splitlines() if "srun" in line]
    steps = [line.split("--nodelist=")[1].split()[0] for line in srun if "--overlap" not in line]  # not the watch
    assert steps == ["gpu17,gpu18", "gpu17,gpu19"]
    submitted = [line for line in calls.read_text().splitlines() if line.startswith("sbatch")]
    assert [line for line in submitted if "--dependency afternotok:4242" not in line] == []  # its successor only
    assert not (run_dir / "unhealthy.json").exists()


def test_kubernetes_manifest_is_an_indexed_job_with_a_headless_service():
    import yaml

    result = subprocess.run(
        [
            "bash",
            str(ROOT / "launch" / "k8s.sh"),
            "--image",
            "registry/llama-jax:1",
            "--name",
            "pretrain",
            "--processes",
            "4",
            "--gpus-per-pod",
            "8",
            "--port",
            "8476",
            "--dry-run",
            "llama3_8b",
            "run.dir=/runs/8b",
            'train.sample_prompt=say "hi"',
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    account, role, binding, service, job = yaml.safe_load_all(result.stdout)
    # The pods' service account may label nodes: the supervisor keeps the job off a node the pre-flight check named.
    assert account["kind"] == "ServiceAccount" and account["metadata"]["name"] == "pretrain"
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    assert binding["subjects"][0]["name"] == "pretrain" and binding["roleRef"]["name"] == role["metadata"]["name"]
    assert service["kind"] == "Service" and service["spec"]["clusterIP"] == "None"
    assert service["spec"]["selector"] == {"job-name": "pretrain"}
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 4
    pod = spec["template"]["spec"]
    assert pod["subdomain"] == "pretrain"  # pod i is pretrain-i.pretrain
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}
    assert env["JAX_COORDINATOR_ADDRESS"] == "pretrain-0.pretrain:8476"
    assert env["JAX_NUM_PROCESSES"] == "4"
    assert env["JAX_PROCESS_ID"] == {
        "fieldRef": {"fieldPath": "metadata.annotations['batch.kubernetes.io/job-completion-index']"}
    }
    assert container["command"] == [
        "llama-jax",
        "supervise",
        "--",
        "llama-jax",
        "train",
        "llama3_8b",
        *LAUNCHER_DEFAULTS,
        "run.dir=/runs/8b",
        'train.sample_prompt=say "hi"',
    ]
    assert pod["serviceAccountName"] == "pretrain"
    assert env["LLAMA_JAX_LABEL_UNHEALTHY_NODES"] == "llama-jax.io/unhealthy=true"
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    assert mounts["shm"] == "/dev/shm" and {"name": "shm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 8
    bad_input, unhealthy = spec["podFailurePolicy"]["rules"]
    assert bad_input["action"] == "FailJob" and bad_input["onExitCodes"]["values"] == [2, 74]  # bad input, storage
    # An unhealthy device (exit 71): the pod counts as failed and is replaced, off a node labelled unhealthy.
    assert unhealthy["action"] == "Count" and unhealthy["onExitCodes"]["values"] == [71]
    assert env["LLAMA_JAX_NODE_NAME"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    (term,) = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term["matchExpressions"] == [{"key": "llama-jax.io/unhealthy", "operator": "DoesNotExist"}]


def test_kubernetes_spares_are_placeholder_pods_any_trainer_pod_preempts():
    """--spares 2: two pods hold a trainer pod's GPUs each, on the nodes the trainers may use, at a priority below the
    trainers' default (0) that never preempts; a replaced trainer pod evicts one and starts on its node at once."""
    import yaml

    command = ["bash", str(ROOT / "launch" / "k8s.sh"), "--image", "registry/llama-jax:1", "--name", "pretrain"]
    result = subprocess.run(
        [*command, "--gpus-per-pod", "8", "--spares", "2", "--dry-run", "llama3_8b"], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stderr
    *trainer, priority, spares = yaml.safe_load_all(result.stdout)
    job = trainer[-1]
    assert job["kind"] == "Job" and "priorityClassName" not in job["spec"]["template"]["spec"]
    assert priority["kind"] == "PriorityClass" and priority["metadata"]["name"] == "pretrain-spare"
    assert priority["value"] < 0 and priority["preemptionPolicy"] == "Never" and priority["globalDefault"] is False
    assert spares["kind"] == "Deployment" and spares["spec"]["replicas"] == 2
    pod = spares["spec"]["template"]["spec"]
    assert spares["spec"]["selector"]["matchLabels"] == spares["spec"]["template"]["metadata"]["labels"]
    assert pod["priorityClassName"] == "pretrain-spare" and pod["terminationGracePeriodSeconds"] == 0
    assert pod["affinity"] == job["spec"]["template"]["spec"]["affinity"]  # off unhealthy nodes, as the trainers
    (reserve,) = pod["containers"]
    (trainer_container,) = job["spec"]["template"]["spec"]["containers"]
    assert reserve["resources"] == trainer_container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    bad = subprocess.run([*command, "--spares", "two", "--dry-run", "tiny"], capture_output=True, text=True)
    assert bad.returncode == 2 and "--spares must be integers" in bad.stderr


def test_kubernetes_without_an_image_exits_2():
    result = subprocess.run(
        ["bash", str(ROOT / "launch" / "k8s.sh"), "--dry-run", "tiny"], capture_output=True, text=True
    )
    assert result.returncode == 2 and "--image is required" in result.stderr


def test_multihost_script_starts_every_host_with_its_id(tmp_path):
    env = fakes(tmp_path)
    args = ["--hosts", "hostA,hostB,hostC", "--port", "5555", "--", "tiny", "run.dir=/shared/t"]
    dry = subprocess.run(
        ["bash", str(ROOT / "launch" / "multihost.sh"), "--dry-run", *args], capture_output=True, text=True, env=env
    )
    assert dry.returncode == 0, dry.stderr
    header, *lines = dry.stdout.splitlines()
    assert header == "# 3 processes, one per host; coordinator hostA:5555"
    assert [shlex.split(line)[1] for line in lines] == ["hostA", "hostB", "hostC"]
    for i, line in enumerate(lines):
        remote = shlex.split(shlex.split(line)[2])
        assert f"JAX_PROCESS_ID={i}" in remote and "JAX_COORDINATOR_ADDRESS=hostA:5555" in remote
    ran = subprocess.run(
        ["bash", str(ROOT / "launch" / "multihost.sh"), *args], capture_output=True, text=True, env=env, timeout=60
    )
    assert ran.returncode == 0, ran.stderr
    processes = processes_of(ran.stdout)
    assert [p["JAX_PROCESS_ID"] for p in processes] == ["0", "1", "2"]
    assert {p["JAX_COORDINATOR_ADDRESS"] for p in processes} == {"hostA:5555"}
    assert {p["JAX_NUM_PROCESSES"] for p in processes} == {"3"}


def gpu_env_xla_flags() -> str:
    flags = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu_env.sh")],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if k != "XLA_FLAGS"},
        check=True,
    ).stdout
    return dict(line.split("=", 1) for line in flags.splitlines())["XLA_FLAGS"]


def flag_checker():
    """tests/golden/make_xla_gpu_flags.py, which made the golden flag list: its functions read a plugin too."""
    spec = importlib.util.spec_from_file_location("make_xla_gpu_flags", ROOT / "tests/golden/make_xla_gpu_flags.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_known_and_current(flag_names: list[str], known: dict, source: str) -> None:
    unknown = [f for f in flag_names if f not in known["flags"]]
    assert not unknown, f"{source} does not know {unknown}: XLA would abort"
    aliases = {f: known["deprecated"][f] for f in flag_names if f in known["deprecated"]}
    assert not aliases, f"deprecated aliases in gpu_env.sh (flag: its current name): {aliases}"


def test_recommended_gpu_flags_are_those_of_the_gpu_jaxlib():
    """XLA aborts on an unknown flag, and deprecated aliases go away: every flag gpu_env.sh sets is a name the
    CUDA plugin's binary holds (its xla_* strings: the flags and a few other identifiers, so a superset) and
    none is one of the aliases its help marks deprecated (the xla_gpu_enable_pipelined_* trio, which
    gpu_env.sh used before), MaxText's H100 set among them. Checked against the list read from
    jax-cuda13-pjrt 0.12.0's binary, and against the installed CUDA plugin if any."""
    flags = gpu_env_xla_flags()
    names = [f.removeprefix("--").split("=", 1)[0] for f in flags.split()]
    for maxtext in (
        "--xla_gpu_enable_triton_gemm=false",
        "--xla_gpu_enable_command_buffer=",
        "--xla_disable_hlo_passes=rematerialization",
        "--xla_gpu_enable_all_gather_combine_by_dim=false",
        "--xla_gpu_enable_reduce_scatter_combine_by_dim=false",
        "--xla_gpu_pipeline_all_gather=on",
    ):
        assert maxtext in flags.split()
    golden = json.loads((ROOT / "tests/golden/xla_gpu_flags.json").read_text())
    assert golden["deprecated"]["xla_gpu_enable_pipelined_all_gather"] == "xla_gpu_pipeline_all_gather"
    assert "xla_gpu_graph_level" not in golden["flags"]  # removed from XLA (the golden is not a blind list)
    assert_known_and_current(names, golden, golden["source"])
    checker = flag_checker()
    for plugin in ("xla_cuda13", "xla_cuda12"):  # the installed plugin, where there is one
        try:
            module = importlib.import_module(f"jax_plugins.{plugin}")
        except ImportError:
            continue
        binary = Path(module.__file__).parent / "xla_cuda_plugin.so"
        assert_known_and_current(names, checker.known_flags(checker.plugin_binary(binary)), str(binary))


@pytest.mark.skipif(
    tuple(int(p) for p in jaxlib.__version__.split(".")[:3]) < (0, 11, 1),
    reason="gpu_env.sh's flags need jaxlib >= 0.11.1 (the gpu extra's floor); checked against the "
    "GPU plugin's flag list above",
)
def test_recommended_gpu_flags_parse_in_the_installed_jaxlib():
    """This jaxlib (CPU) registers XLA's GPU flags too: a run with gpu_env.sh's XLA_FLAGS starts and computes."""
    run = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float((jnp.ones(2) + 1).sum()))"],
        capture_output=True,
        text=True,
        env={**os.environ, "XLA_FLAGS": gpu_env_xla_flags(), "JAX_PLATFORMS": "cpu"},
    )
    assert run.returncode == 0 and run.stdout.strip() == "4.0", run.stderr


def test_gpu_flags_on_an_older_jaxlib_are_one_line_and_exit_2(tmp_path):
    """Before jaxlib 0.11.1 XLA aborts on gpu_env.sh's pipelining flags with a fatal log: the CLI says so in one
    line first. On a newer jaxlib the same flags pass this check (the run then fails on its bad override)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_gpu_pipeline_all_gather=on", "JAX_PLATFORMS": "cpu"}
    run = subprocess.run(
        [sys.executable, "-m", "llama_jax", "train", "tiny", f"run.dir={tmp_path / 'run'}", "train.no_such_key=1"],
        capture_output=True,
        text=True,
        env=env,
    )
    assert run.returncode == 2 and len(run.stderr.strip().splitlines()) == 1, run.stderr
    old = tuple(int(p) for p in jaxlib.__version__.split(".")[:3]) < (0, 11, 1)
    assert ("LLAMA_JAX_GPU_FLAGS=off" in run.stderr) == old, run.stderr
    assert not (tmp_path / "run").exists()


def test_gpu_flags_can_be_left_out():
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"LLAMA_JAX_GPU_FLAGS": "off"}
    flags = subprocess.run(
        ["bash", str(ROOT / "launch" / "gpu_env.sh")], capture_output=True, text=True, env=env, check=True
    ).stdout
    assert flags.splitlines()[0] == "XLA_FLAGS="  # an older jaxlib on some host: nothing for XLA to abort on


def test_readme_cluster_commands_run_as_dry_runs():
    """The multi-host guide's cluster commands, each run here with --dry-run (sbatch's as Slurm would)."""
    import yaml

    env = {**os.environ, "LLAMA_JAX": "llama-jax"}
    commands = [c for c in readme_commands("launch/") if "launch/local.sh" not in c]
    scripts = sorted({Path(w).name for c in commands for w in shlex.split(c) if w.startswith("launch/")})
    assert scripts == ["k8s.sh", "multihost.sh", "slurm.sbatch"]
    for command in commands:
        words = shlex.split(command)
        index = next(i for i, w in enumerate(words) if w.startswith("launch/"))
        script, args = ROOT / words[index], words[index + 1 :]
        run_env = dict(env)
        if words[0] == "sbatch":  # sbatch --nodes N: inside the job Slurm says how many nodes it has
            run_env["SLURM_JOB_NUM_NODES"] = words[words.index("--nodes") + 1]
        if "--dry-run" not in args:
            args = ["--dry-run", *args]
        result = subprocess.run(["bash", str(script), *args], capture_output=True, text=True, env=run_env)
        assert result.returncode == 0, (command, result.stderr)
        if script.name == "k8s.sh":
            spares = ["PriorityClass", "Deployment"] if "--spares" in args else []  # placeholder pods
            assert [d["kind"] for d in yaml.safe_load_all(result.stdout)] == [
                "ServiceAccount",
                "ClusterRole",
                "ClusterRoleBinding",
                "Service",
                "Job",
                *spares,
            ]  # the account labels nodes
        elif script.name == "slurm.sbatch":
            nodes = int(args[args.index("--nodes") + 1]) if "--nodes" in args else int(run_env["SLURM_JOB_NUM_NODES"])
            assert result.stdout.startswith(f"# {nodes} node(s) x 8 process(es) = {8 * nodes} processes")
        else:
            remote = " ".join(shlex.split(result.stdout.splitlines()[-1]))  # ssh's command, or the one to type
            assert "JAX_PROCESS_ID=1" in remote and "train llama3_8b " + " ".join(LAUNCHER_DEFAULTS) in remote
            assert remote.endswith("run.dir=/shared/runs/8b")  # the guide's keys come after them
