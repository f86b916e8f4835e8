"""Every command README.md and docs/*.md show is run or parsed here (or in the test CLAIMS names), so the
documentation cannot drift from the code."""

import argparse
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
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]  # the README first: its commands come first
LOGS = sorted((ROOT / "docs" / "measurements").glob("*.md"))  # dated logs: their links are checked, not their commands


def bash_commands(text: str) -> list[str]:
    """The command lines of a page's bash blocks, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", text, flags=re.DOTALL)
    lines = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line]


def documented_commands() -> list[str]:
    """Every command of README.md and docs/*.md, in page order, each once (a guide may repeat another's)."""
    return list(dict.fromkeys(c for page in PAGES for c in bash_commands(page.read_text())))


def readme_commands(prefix: str) -> list[str]:
    """The documented commands that start with `prefix`, or run it after an environment prefix or a command."""
    return [line for line in documented_commands() if line.startswith(prefix) or f" {prefix}" in line]


def llama_jax_args(command: str) -> list[str]:
    """The arguments after `llama-jax` in a README command line (environment prefix dropped)."""
    words = shlex.split(command)
    index = next(i for i, w in enumerate(words) if w.endswith("llama-jax"))
    return words[index + 1 :]


def test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one():
    assert readme_commands("make train")[0] == "make train"
    assert "make test" in readme_commands("make test")
    assert "make test" in (ROOT / ".ci" / "run").read_text()


def test_make_passes_args_to_the_trainer():
    assert 'make train ARGS="train.steps=100 run.dir=runs/short"' in readme_commands("make train ARGS=")
    dry_run = subprocess.run(
        ["make", "-n", "-W", ".venv/.installed", "train", "ARGS=train.steps=100 run.dir=runs/short"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "llama-jax train train.steps=100 run.dir=runs/short" in dry_run


@pytest.mark.parametrize(
    "command",
    [
        c
        for c in readme_commands("llama-jax train")
        + readme_commands(".venv/bin/llama-jax train")  # the installed command
        if "train.step=5" not in c and "llama-jax supervise" not in c and "tune.yaml" not in c
    ],
)  # written by `llama-jax tune`: test_tune.py
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
    (run / "metrics.jsonl").write_text(
        '{"step": 0, "eval_loss": 8.3}\n{"step": 10, "loss": 7.0, "tokens_per_s": 5000.0, "mfu": 0.3}\n'
    )
    assert cli.main([subcommand, str(run)]) == 0
    assert (run / "report.png").read_bytes().startswith(b"\x89PNG")


def test_readme_preset_table_matches_the_presets():
    from llama_jax.config import load_config, preset_names
    from llama_jax.model.llama import param_count

    rows = re.findall(r"^\| `(\w+)`(?: \(default\))? \| ([\d.]+)([MB]) \|", README, flags=re.MULTILINE)
    assert sorted(name for name, _, _ in rows) == preset_names()
    for name, number, unit in rows:
        stated = float(number) * (1e6 if unit == "M" else 1e9)
        assert abs(param_count(load_config(name).model) - stated) / stated < 0.01, name


@pytest.mark.parametrize("command", [c for c in readme_commands("llama-jax plan") if "--target" not in c])
def test_readme_plan_commands_compile_and_report(command, capsys):
    """Each README plan command runs on this process's 8 simulated devices (its XLA_FLAGS prefix)."""
    args = llama_jax_args(command)
    assert "--xla_force_host_platform_device_count=8" in command
    assert cli.main(args + ([] if "--json" in args else ["--json"])) == 0
    report = json.loads(capsys.readouterr().out)
    plans = (
        report.values()
        if "--compare-remat" in args
        else [s["plan"] for s in report["stages"]]
        if "stages" in report  # a staged run (train.stages): every stage's plan
        else [report]
    )
    assert all(plan["hlo_flops"] > 0 for plan in plans)


@pytest.mark.parametrize("command", readme_commands("llama-jax doctor"))
def test_readme_doctor_commands_check_the_devices(command, capsys):
    """Each README doctor command on this process's 8 simulated devices: healthy, or exit 71 naming the injected
    devices. The ratio is relaxed: these devices share the cores with the other tests (test_preflight.py)."""
    assert "--xla_force_host_platform_device_count=8" in command
    args = llama_jax_args(command)
    status = cli.main(args + ["fault.preflight_min_ratio=0.5"])
    out, err = capsys.readouterr()
    injected = sorted(int(a.split("=")[1]) for a in args if a.startswith("inject."))
    assert status == (71 if injected else 0), err
    assert sorted(int(d) for d in re.findall(r"device (\d+) \(process 0 on ", err)) == injected
    assert "median" in out


@pytest.mark.parametrize("command", [c for c in readme_commands("llama-jax tune") if "--target" not in c])
def test_readme_tune_commands_enumerate_their_candidates(command):
    """Each README tune command, as a --dry-run on its XLA_FLAGS devices (the search itself: test_tune.py)."""
    flags = re.search(r"XLA_FLAGS=(\S+)", command)
    env = {**os.environ, "XLA_FLAGS": flags.group(1) if flags else ""}
    result = subprocess.run(
        [sys.executable, "-m", "llama_jax", *llama_jax_args(command), "--dry-run"],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
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
    from llama_jax.data.streams import open_data

    config = load_config(args[0], args[1:] + ["train.batch_size=2", "train.seq_len=32"])
    data = open_data(config, print_fn=lambda _: None)
    assert data.train.batch(0)["tokens"].shape == (2, 32)


def test_readme_supervise_command_runs_its_train_command(tmp_path):
    """The supervisor runs the guide's command as shown (its train command only prints its config here)."""
    (command,) = readme_commands("llama-jax supervise")
    args = llama_jax_args(command)
    split = args.index("--")
    child = [sys.executable, "-m", "llama_jax", *llama_jax_args(" ".join(args[split + 1 :]))]
    child = [a.replace("run.dir=runs/", f"run.dir={tmp_path}/") for a in child]
    proc = subprocess.run(
        [sys.executable, "-m", "llama_jax", *args[: split + 1], *child, "--print-config"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "checkpoint:\n  every_steps: 20" in proc.stdout and "start #1" in proc.stderr


def test_readme_your_own_data_in_three_commands(tmp_path):
    """prepare -> train -> generate as the README shows them, with the installed command on one CPU device (the
    run cut to 2 short steps, 8 new tokens)."""
    section = README.split("## Your own data in three commands")[1].split("\n## ")[0]
    prepare, train, generate = bash_commands(section)
    assert [llama_jax_args(c)[0] for c in (prepare, train, generate)] == ["prepare", "train", "generate"]
    texts = tmp_path / "path" / "to" / "texts"
    texts.mkdir(parents=True)
    words = "once upon a time there was a tiny model that read every line of its own small corpus".split()
    for i in range(30):
        (texts / f"story{i}.txt").write_text(" ".join(words[(i + j) % len(words)] for j in range(200 + 10 * i)))
    installed = str(Path(sys.executable).parent / "llama-jax")
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device, as on a laptop

    def run(command: str, *extra: str) -> str:
        argv = [installed if w == ".venv/bin/llama-jax" else w for w in shlex.split(command)]
        assert argv[0] == installed, command
        proc = subprocess.run([*argv, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, (command, proc.stderr)
        return proc.stdout

    run(prepare)
    assert (tmp_path / "stores" / "mine" / "meta.json").is_file()
    run(train, "train.steps=2", "train.warmup_steps=1", "train.batch_size=4", "train.seq_len=32")
    run_dir = tmp_path / "runs" / "mine"
    assert (run_dir / "checkpoints" / "2").is_dir() and (run_dir / "tokenizer.json").is_file()
    prompt = shlex.split(generate)[shlex.split(generate).index("--prompt") + 1]
    assert run(generate, "--max-new-tokens", "8").startswith(prompt)


class Parsed(Exception):
    """Raised in place of a bench script's measurements: its arguments are what its own parser made of them."""


def bench_arguments(command: str, monkeypatch) -> argparse.Namespace:
    """A documented `bench/NAME.py ARGS` command's ARGS, parsed by that script's own parser: its main() stops
    right after parse_args (a bad argument exits 2 there, as it would for a user), so nothing is measured."""
    words = shlex.split(command)
    index = next(i for i, w in enumerate(words) if w.startswith("bench/"))
    spec = importlib.util.spec_from_file_location(Path(words[index]).stem, ROOT / words[index])
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    parse = argparse.ArgumentParser.parse_args

    def parse_and_stop(parser, args=None, namespace=None):
        raise Parsed(parse(parser, words[index + 1 :], namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_and_stop)
    with pytest.raises(Parsed) as parsed:
        script.main()
    return parsed.value.args[0]


@pytest.mark.parametrize("command", [c for c in readme_commands("bench/") if "bench/chaos.py" not in c])
def test_readme_bench_commands_parse(command, monkeypatch):
    """Each documented benchmark command (bench/chaos.py's: test_readme_chaos_drill_commands_parse) parses, and the
    settings it hands to a preset resolve to valid configs."""
    args = bench_arguments(command, monkeypatch)
    if hasattr(args, "overrides"):  # PRESET's config with the overrides (and with each of step.py's --versus)
        from llama_jax.config import load_config

        for versus in getattr(args, "versus", None) or [""]:  # bench/step.py has --versus
            load_config(args.preset, [*args.overrides, *versus.split()])


# Every command line of a bash block in README.md or docs/*.md, and the test that runs it (or, for what cannot
# run here, parses it or runs it as a dry run): the first pattern a command matches claims it.
CLAIMS = [
    (
        r"^llama-jax (plan|tune) .*--target ",
        "test_gpu_target.py::test_readme_target_commands_compile_for_the_gpus_or_say_what_is_missing",
    ),
    (r"^make (train|test)$", "test_readme.py::test_readme_has_the_two_setup_commands_and_ci_runs_the_test_one"),
    (r"^make train ARGS=", "test_readme.py::test_make_passes_args_to_the_trainer"),
    (
        r"^make gpu-check$",
        "test_gpu_check.py::test_readme_make_gpu_check_sources_the_gpu_settings_and_answers_in_one_line",
    ),
    (
        r"^\.venv/bin/llama-jax (prepare|generate|train .*data\.sources=)",
        "test_readme.py::test_readme_your_own_data_in_three_commands",
    ),
    (r"^\.venv/bin/llama-jax train ", "test_readme.py::test_readme_train_commands_resolve_to_valid_configs"),
    (
        r"^llama-jax supervise .* -- llama-jax train ",
        "test_readme.py::test_readme_supervise_command_runs_its_train_command",
    ),
    (r"^llama-jax train .*train\.stages=", "test_stages.py::test_the_recipe_guide_trains_its_stages_and_averages"),
    (r"^llama-jax (train .*run\.profile_steps=|profile )", "test_profile.py::test_the_documented_profile_commands"),
    (r"^llama-jax train \S+-tune\.yaml$", "test_readme.py::test_readme_trains_the_file_tune_writes"),
    (r"^(XLA_FLAGS=\S+ )?llama-jax train ", "test_readme.py::test_readme_train_commands_resolve_to_valid_configs"),
    (r"^llama-jax prepare ", "test_readme.py::test_readme_data_guide_commands_build_and_train_on_stores"),
    (r"^llama-jax report ", "test_readme.py::test_readme_report_command_plots_a_run"),
    (r"^llama-jax average ", "test_average.py::test_the_documented_average_command"),
    (r"^XLA_FLAGS=\S+ llama-jax plan ", "test_readme.py::test_readme_plan_commands_compile_and_report"),
    (r"^XLA_FLAGS=\S+ llama-jax doctor ", "test_readme.py::test_readme_doctor_commands_check_the_devices"),
    (r"^(XLA_FLAGS=\S+ )?llama-jax tune ", "test_readme.py::test_readme_tune_commands_enumerate_their_candidates"),
    (r"^llama-jax (convert|generate) .*mesh\.", "test_inference.py::test_readme_sharded_commands"),
    (
        r"^llama-jax (convert|generate|eval) runs/(lora|prompt) ",
        "test_peft.py::test_readme_adapter_guide_commands_on_lora_and_p_tuning_runs",
    ),
    (
        r"^llama-jax (convert|generate|eval) /adapters/",
        "test_peft_read.py::test_the_guides_commands_on_an_adapter_made_by_peft",
    ),
    (r"^llama-jax eval \S+ --tasks ", "test_evaluation.py::test_the_evaluation_guide_commands"),
    (r"^llama-jax (convert|generate|eval) ", "test_hf.py::test_readme_hugging_face_guide_commands"),
    (r"^launch/local\.sh ", "test_launch.py::test_readme_local_commands_dry_run"),
    (
        r"^launch/slurm\.sbatch --dry-run .* llama3_405b ",
        "test_pipeline.py::test_the_readme_405b_layout_passes_the_mesh_checks",
    ),  # and, as a dry run, test_launch.py
    (
        r"^(sbatch --nodes \d+ )?launch/(slurm\.sbatch|k8s\.sh|multihost\.sh) ",
        "test_launch.py::test_readme_cluster_commands_run_as_dry_runs",
    ),  # sbatch's: the script's own --dry-run
    (r"^\.venv/bin/python bench/chaos\.py ", "test_readme.py::test_readme_chaos_drill_commands_parse"),
    (
        r"^\.venv/bin/python bench/rehearsal\.py ",
        "test_goodput_projection.py::test_readme_rehearsal_commands_parse_and_a_short_rehearsal_survives_a_lost_host",
    ),
    (r"^llama-jax goodput ", "test_goodput_projection.py::test_readme_goodput_commands_run"),
    (
        r"^(XLA_FLAGS=\S+ )?\.venv(-newest)?/bin/python bench/\w+\.py( |$)",
        "test_readme.py::test_readme_bench_commands_parse",
    ),
]


def test_every_documented_command_is_claimed_by_a_test():
    """A command added to a guide fails here until a test runs it (or parses it) and CLAIMS says which."""
    claimed = {pattern: [] for pattern, _ in CLAIMS}
    unclaimed = []
    for command in documented_commands():
        pattern = next((p for p, _ in CLAIMS if re.search(p, command)), None)
        (claimed[pattern] if pattern else unclaimed).append(command)
    assert not unclaimed, "no test in CLAIMS runs these documented commands:\n" + "\n".join(unclaimed)
    assert not [p for p, commands in claimed.items() if not commands], "CLAIMS entries no documented command matches"
    for _, test in CLAIMS:
        file, name = test.split("::")
        assert f"\ndef {name}(" in (ROOT / "tests" / file).read_text(), f"{test} does not exist"


def test_readme_is_a_front_door_and_its_links_resolve():
    """The README stays short (the guides are in docs/), and every relative link of it, of docs/*.md and of the
    logs in docs/measurements/ names a file that exists and, with #anchor, one of that file's headings."""
    assert len(README.splitlines()) <= 200

    def headings(text: str) -> set[str]:
        prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)  # a `# comment` in a code block is no heading
        return {
            re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.+)$", prose, flags=re.MULTILINE)
        }

    broken = []
    for page in PAGES + LOGS:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            if not linked.exists() or (anchor and anchor not in headings(linked.read_text())):
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    assert not broken, broken
