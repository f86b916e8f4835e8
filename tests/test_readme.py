"""Every command the README shows is checked here, so the README cannot drift from the code."""

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from llama_jax import cli

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def readme_commands(prefix: str) -> list[str]:
    blocks = re.findall(r"```bash\n(.*?)```", README, flags=re.DOTALL)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(prefix) or f" {prefix}" in line]


def llama_jax_args(command: str) -> list[str]:
    """The arguments after `llama-jax` in a README command line (environment prefix dropped)."""
    words = shlex.split(command)
    index = next(i for i, w in enumerate(words) if w.endswith("llama-jax"))
    return words[index + 1:]


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    assert readme_commands("make train")[0] == "make train"
    assert "make test" in readme_commands("make test")
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_passes_args_to_the_trainer():
    dry_run = subprocess.run(["make", "-n", "-W", ".venv/.installed", "train", "ARGS=train.steps=100 run.dir=runs/short"],
                             cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert "llama-jax train train.steps=100 run.dir=runs/short" in dry_run


@pytest.mark.parametrize("command", [c for c in readme_commands("llama-jax train")
                                     if "train.step=5" not in c and "llama-jax supervise" not in c
                                     and "tune.yaml" not in c])  # written by `llama-jax tune`: test_tune.py
def test_readme_train_commands_resolve_to_valid_configs(command, tmp_path, capsys):
    args = [a.replace("path/to/texts/", str(tmp_path)) for a in llama_jax_args(command)]
    assert cli.main(args + ["--print-config"]) == 0
    assert "model:" in capsys.readouterr().out


def test_readme_error_example_is_what_users_see(tmp_path, capsys):
    shown = re.search(r"\$ llama-jax (train train\.step=5)\n(llama-jax: error: .*)\n", README)
    assert cli.main(shown.group(1).split() + [f"run.dir={tmp_path}/run"]) == 2
    assert capsys.readouterr().err.strip() == shown.group(2)


def test_readme_chaos_drill_commands_parse():
    spec = importlib.util.spec_from_file_location("chaos", ROOT / "bench" / "chaos.py")
    chaos = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(chaos)
    commands = readme_commands(".venv/bin/python bench/chaos.py")
    assert len(commands) >= 3
    for command in commands:
        args = chaos.arguments(shlex.split(command)[2:])
        assert args.steps > 0 and args.kills > 0
    assert any(chaos.arguments(shlex.split(c)[2:]).processes == 2 for c in commands)


def test_readme_report_command_plots_a_run(tmp_path):
    (command,) = readme_commands("llama-jax report")
    subcommand, run_dir = llama_jax_args(command)
    run = tmp_path / run_dir
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 0, "eval_loss": 8.3}\n'
                                       '{"step": 10, "loss": 7.0, "tokens_per_s": 5000.0, "mfu": 0.3}\n')
    assert cli.main([subcommand, str(run)]) == 0
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")


def test_readme_preset_table_matches_the_presets():
    from llama_jax.config import load_config, preset_names
    from llama_jax.model import param_count

    rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \| ([\d.]+)([MB]) \|", README, flags=re.MULTILINE)
    assert sorted(name for name, _, _ in rows) == preset_names()
    for name, number, unit in rows:
        stated = float(number) * (1e6 if unit == "M" else 1e9)
        assert abs(param_count(load_config(name).model) - stated) / stated < 0.01, name


@pytest.mark.parametrize("command", readme_commands("llama-jax plan"))
def test_readme_plan_commands_compile_and_report(command, capsys):
    """Each README plan command runs on this process's 8 simulated devices (its XLA_FLAGS prefix)."""
    args = llama_jax_args(command)
    assert "--xla_force_host_platform_device_count=8" in command
    assert cli.main(args + ([] if "--json" in args else ["--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    plans = report.values() if "--compare-remat" in args else [report]
    assert all(plan["hlo_flops"] > 0 for plan in plans)


@pytest.mark.parametrize("command", readme_commands("llama-jax doctor"))
def test_readme_doctor_commands_check_the_devices(command, capsys):
    """Each README doctor command on this process's 8 simulated devices: healthy, or exit 71 naming the injected
    devices. The ratio is relaxed: these devices share the cores with the other tests (test_preflight.py)."""
    assert "--xla_force_host_platform_device_count=8" in command
    args = llama_jax_args(command)
    status = cli.main(args + ["fault.preflight_min_ratio=0.5"])
    out, err = capsys.readouterr()
    injected = sorted(int(a.split("=")[1]) for a in args if a.startswith("fault.inject_"))
    assert status == (71 if injected else 0), err
    assert sorted(int(d) for d in re.findall(r"device (\d+) \(process 0 on ", err)) == injected
    assert "median" in out


@pytest.mark.parametrize("command", readme_commands("llama-jax tune"))
def test_readme_tune_commands_enumerate_their_candidates(command):
    """Each README tune command, as a --dry-run on its XLA_FLAGS devices (the search itself: test_tune.py)."""
    flags = re.search(r"XLA_FLAGS=(\S+)", command)
    env = {**os.environ, "XLA_FLAGS": flags.group(1) if flags else ""}
    result = subprocess.run([sys.executable, "-m", "llama_jax", *llama_jax_args(command), "--dry-run"], env=env,
                            cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    summary = result.stdout.strip().splitlines()[-1]
    total, valid = map(int, re.match(r"(\d+) candidates: (\d+) valid", summary).groups())
    assert 0 < valid <= total


def test_readme_trains_the_file_tune_writes():
    (tune_command,) = [c for c in readme_commands("llama-jax tune") if "--out" in c]
    out = llama_jax_args(tune_command)[llama_jax_args(tune_command).index("--out") + 1]
    assert f"llama-jax train {out}" in readme_commands("llama-jax train")


def test_readme_data_guide_commands_build_and_train_on_stores(tmp_path, monkeypatch):
    """The prepare commands of the data guide run as shown, and the train command's config opens them."""
    monkeypatch.chdir(tmp_path)
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
    (tmp_path / "corpus" / "web").mkdir(parents=True)
    (tmp_path / "corpus" / "books").mkdir()
    for part in range(2):
        lines = [json.dumps({"text": " ".join(words[(i + j) % 10] for j in range(40 + i))}) for i in range(30)]
        (tmp_path / "corpus" / "web" / f"part{part}.jsonl").write_text("\n".join(lines) + "\n")
    for i in range(30):
        (tmp_path / "corpus" / "books" / f"book{i}.txt").write_text(" ".join(words[::-1] * (5 + i)))
    for command in readme_commands("llama-jax prepare"):
        assert cli.main(llama_jax_args(command)) == 0, command
    (train_command,) = [c for c in readme_commands("llama-jax train") if "data.weights" in c]
    args = llama_jax_args(train_command)[1:]

    from llama_jax.config import load_config
    from llama_jax.data.pipeline import open_data

    config = load_config(args[0], args[1:] + ["train.batch_size=2", "train.seq_len=32"])
    data = open_data(config, log=lambda _: None)
    assert data.train.batch(0)["tokens"].shape == (2, 32)


def test_readme_supervise_command_runs_its_train_command(tmp_path):
    """The supervisor runs the guide's command as shown (its train command only prints its config here)."""
    (command,) = readme_commands("llama-jax supervise")
    args = llama_jax_args(command)
    split = args.index("--")
    child = [sys.executable, "-m", "llama_jax", *llama_jax_args(" ".join(args[split + 1:]))]
    child = [a.replace("run.dir=runs/", f"run.dir={tmp_path}/") for a in child]
    proc = subprocess.run([sys.executable, "-m", "llama_jax", *args[:split + 1], *child, "--print-config"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint:\n  every_steps: 20" in proc.stdout and "start #1" in proc.stderr
