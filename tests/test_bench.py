"""bench/step.py's comparison with the peer (Hugging Face transformers + PyTorch, bench/peer.py), on a model small
enough to take seconds. The figures themselves: docs/performance.md."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from llama_jax.config import load_config, preset_names

ROOT = Path(__file__).resolve().parents[1]
# The tiny preset, shrunk: a step of the peer's eager PyTorch takes well under a second.
SMALL = ["model.vocab_size=320", "model.d_model=64", "model.ffn_dim=128", "train.batch_size=8", "train.seq_len=32"]
# The peer runs on --peer-python, by default this interpreter; without torch and transformers its measurement
# cannot run (pip install torch==2.13.0 transformers), its config part still does.
MISSING = [name for name in ("torch", "transformers") if importlib.util.find_spec(name) is None]


def load_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return script


def test_step_runs_the_peer_on_the_same_model():
    """bench/step.py's peer path (what `--peer --no-peer-compile` runs after timing ours): bench/peer.py in its own
    process on --peer-python, here this interpreter, finds the preset where the project keeps presets (it looked in
    llama_jax/configs/ and died with FileNotFoundError) and times the same model and batch as ours, the overrides
    included, eager only."""
    peer = load_script("step").run_peer(sys.executable, "tiny", SMALL, steps=1, compiled=False)
    if MISSING:
        # It read its config, then stopped at the import: not at the preset's path.
        assert "No module named" in peer["error"] and any(name in peer["error"] for name in MISSING), peer
        pytest.skip(f"{' and '.join(MISSING)} not installed here: the peer's PyTorch step is not run")
    assert "error" not in peer, peer["error"]
    config = load_config("tiny", SMALL)
    assert peer["dims"] == {
        "vocab": 320,
        "d_model": 64,
        "layers": config.model.n_layers,
        "heads": 4,
        "kv_heads": 2,
        "ffn": 128,
        "head_dim": 16,
        "tied": False,
        "rope_theta": config.model.rope_theta,
        "batch": 8,
        "seq": 32,
    }
    assert peer["preset"] == "tiny" and peer["overrides"] == SMALL and "compiled" not in peer
    assert peer["eager"]["tokens_per_s"] > 0 and peer["eager"]["params"] > 0


@pytest.mark.skipif(bool(MISSING), reason="torch and transformers not installed here: no PyTorch step to profile")
def test_the_peer_profile_accounts_for_its_step(tmp_path):
    """bench/peer.py --profile: torch.profiler's op times of an eager step add up to about the step (its ops run one
    after another on the calling thread), with the matmuls inside them."""
    out = tmp_path / "peer.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "peer.py"), "--preset", "tiny", "--steps", "1", "--warmup", "1"]
        + ["--profile", "2", "--json", str(out), *SMALL],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    profile = json.loads(out.read_text())["eager"]["profile"]
    assert 0 < profile["matmul_s"] < profile["ops_s"] <= 1.05 * profile["step_s"]
    assert "peer eager profile, per step:" in proc.stdout and len(profile["top"]) == 12


def test_peer_finds_every_preset_without_jax():
    """bench/peer.py's dimensions come from llama_jax.config, in a process that imports no JAX (the peer's interpreter
    may have none): every preset by name, with key=value overrides on top."""
    probe = (
        "import json, runpy, sys; peer = runpy.run_path(sys.argv[1]); "
        "print(json.dumps([peer['model_dimensions'](name) for name in sys.argv[2:]]"
        " + [peer['model_dimensions']('bench', ['model.n_layers=2'])])); print('jax' in sys.modules)"
    )
    proc = subprocess.run(
        [sys.executable, "-c", probe, str(ROOT / "bench" / "peer.py"), *preset_names()],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    *found, overridden = json.loads(proc.stdout.splitlines()[0])
    assert proc.stdout.splitlines()[1] == "False"
    for name, dims in zip(preset_names(), found):
        config = load_config(name)
        assert (dims["d_model"], dims["layers"], dims["head_dim"], dims["batch"], dims["seq"]) == (
            config.model.d_model,
            config.model.n_layers,
            config.model.resolved_head_dim,
            config.train.batch_size,
            config.train.seq_len,
        ), name
    assert overridden["layers"] == 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--versus", "remat.policy=save_dot"], "unknown remat.policy 'save_dot'; valid policies: none, full"),
        (["model.d_model=-1"], "model.d_model"),
    ],
)
def test_bad_settings_are_one_line_and_exit_2_before_any_timing(args, message):
    """A config that cannot load (the preset's overrides, or one --versus set) stops bench/step.py at once: one line
    naming it, exit 2, nothing measured."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step.py"), "--preset", "tiny", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.count("\n") == 1 and message in proc.stderr and proc.stdout == "", proc.stderr
