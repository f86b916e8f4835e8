"""Models too big for one device: generation, evaluation and conversion sharded over a mesh of the 8
simulated CPU devices, with the same tokens as one device, and conversions that move one block at a time
through the host (also across processes)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import subprocess_environment
from safetensors.numpy import load_file

from llama_jax import api, cli
from llama_jax.checkpoint import specs
from llama_jax.inference.generate import GREEDY, Generator, generate, params_mesh
from llama_jax.interop import hf

ROOT = Path(__file__).resolve().parents[1]
MODEL = ROOT / "tests" / "golden" / "hf" / "gqa_llama3_untied"  # 4 query heads, 2 kv heads, untied head
# mesh -> (rows of a 4-prompt batch per device, kv heads per device): tensor=2 splits the 2 kv heads, tensor=4
# replicates them (more shards than kv heads); the batch splits over data×fsdp where that divides 4.
MESHES = {
    "fsdp8": (["mesh.fsdp=8"], 4, 2),
    "fsdp2_tensor4": (["mesh.fsdp=2", "mesh.tensor=4"], 2, 2),
    "data2_fsdp2_tensor2": (["mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"], 1, 1),
}
LAYOUT = ["mesh.fsdp=2", "mesh.tensor=4"]


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.fixture(scope="module")
def one_device():
    """The golden model on one device, four prompts of different lengths and their greedy continuations."""
    cfg, params = api.load(f"hf:{MODEL}")
    tokens = np.load(MODEL / "golden.npz")["tokens"]
    prompts = [tokens[0, :3].tolist(), tokens[1, :9].tolist(), tokens[0, 2:7].tolist(), tokens[1, :1].tolist()]
    return cfg, params, prompts, generate(cfg, params, prompts, 8, jax.random.key(0))


@pytest.fixture(scope="module")
def with_tokenizer(tmp_path_factory):
    """The golden model with a byte-level BPE of its vocabulary, and a text file to score."""
    from llama_jax.data.tokenizer import train_bpe

    root = tmp_path_factory.mktemp("model")
    shutil.copytree(MODEL, root / "model")
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps".split()
    texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    train_bpe(texts, 300).save(root / "model")
    (root / "text.txt").write_text("\n".join(texts))
    return root / "model", root / "text.txt"


def test_without_mesh_keys_a_model_loads_on_one_device(one_device):
    _, params, _, _ = one_device
    assert {d for leaf in jax.tree.leaves(params) for d in leaf.devices()} == {jax.devices()[0]}


@pytest.mark.parametrize("mesh", MESHES)
def test_a_sharded_model_and_cache_generate_the_tokens_of_one_device(mesh, one_device):
    cfg, _, prompts, expected = one_device
    overrides, rows, kv_heads = MESHES[mesh]
    cfg, params = api.load(f"hf:{MODEL}", overrides=overrides)
    sizes = dict(params_mesh(params).shape)
    given = dict(o.removeprefix("mesh.").split("=") for o in overrides)
    assert sizes == {
        "pipeline": 1,
        "data": 1,
        "fsdp": 1,
        "sequence": 1,
        "tensor": 1,
        **{k: int(v) for k, v in given.items()},
    }
    q = params["layers"]["attn"]["q_proj"]["kernel"]  # [layers, embed, heads, head_dim]
    assert len(q.devices()) == 8
    assert q.addressable_shards[0].data.shape == (
        cfg.n_layers,
        cfg.d_model // sizes["fsdp"],
        cfg.n_heads // sizes["tensor"],
        cfg.resolved_head_dim,
    )
    embedding = params["embed"]["embedding"]  # [vocab, embed]
    assert embedding.addressable_shards[0].data.shape == (
        cfg.vocab_size // sizes["tensor"],
        cfg.d_model // sizes["fsdp"],
    )

    generator = Generator(cfg, len(prompts), 20, GREEDY, params_mesh(params))
    _, cache = generator.prefill(params, prompts, jax.random.key(0))
    for tensor in jax.tree.leaves(cache):  # [layers, batch, cache_len, kv_heads, head_dim]
        assert len(tensor.devices()) == 8
        assert tensor.addressable_shards[0].data.shape == (cfg.n_layers, rows, 20, kv_heads, cfg.resolved_head_dim)
    assert generate(cfg, params, prompts, 8, jax.random.key(0)) == expected


def test_logits_of_a_sharded_model_match_the_golden_ones():
    cfg, params = api.load(f"hf:{MODEL}", overrides=LAYOUT)
    expected = np.load(MODEL / "golden.npz")
    assert np.abs(api.logits(cfg, params, expected["tokens"]) - expected["logits"]).max() <= 1e-4


def test_evaluation_on_a_mesh_matches_one_device(with_tokenizer):
    model, text = with_tokenizer
    common = ["train.batch_size=8", "train.seq_len=16"]
    sharded = api.evaluate(f"hf:{model}", str(text), common + LAYOUT, max_batches=2, print_fn=lambda _: None)
    single = api.evaluate(
        f"hf:{model}",
        str(text),
        common + ["mesh.fsdp=1"],
        max_batches=2,
        print_fn=lambda _: None,
        devices=jax.devices()[:1],
    )
    assert sharded["tokens"] == single["tokens"] == 2 * 8 * 16
    np.testing.assert_allclose(sharded["loss"], single["loss"], rtol=1e-5)


def test_generate_command_on_a_mesh_prints_what_one_device_prints(with_tokenizer, capsys):
    model, _ = with_tokenizer
    args = ["--prompt", "the quick", "--prompt", "a lazy dog", "--max-new-tokens", "5", "--temperature", "0"]
    assert cli.main(["generate", f"hf:{model}", *args]) == 0
    single = capsys.readouterr().out
    assert cli.main(["generate", f"hf:{model}", *LAYOUT, *args]) == 0
    assert capsys.readouterr().out == single


def test_import_reads_only_blocks_of_each_devices_shards(monkeypatch):
    """With 256-byte blocks, every read from the safetensors files is at most one block, or one layer's
    (or one row's) slice of a device's shard where that is bigger, and the params are those of one read."""
    spec = specs.resolve(f"hf:{MODEL}")
    config = specs.inference_config(spec.model, LAYOUT, batches=False)
    target = specs.param_target(config, specs.inference_mesh(config))
    whole = hf.read_params(MODEL, spec.model, target)
    reads, read = [], hf.SafetensorsReader.read
    monkeypatch.setattr(
        hf.SafetensorsReader, "read", lambda self, name, index: reads.append(read(self, name, index)) or reads[-1]
    )
    blocked = hf.read_params(MODEL, spec.model, target, block_bytes=256)
    unit = max(int(np.prod(t.sharding.shard_shape(t.shape)[1:])) * 4 for t in jax.tree.leaves(target))
    largest_tensor = max(t.nbytes for t in hf_tensors(MODEL).values())
    assert max(r.nbytes for r in reads) <= max(256, unit) < largest_tensor / 30
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(blocked)):
        assert a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_export_pulls_one_tensor_at_a_time_into_shard_files_that_round_trip_exactly(monkeypatch, tmp_path):
    cfg, params = api.load(f"hf:{MODEL}", overrides=LAYOUT)
    pulls, pull = [], hf.pull
    monkeypatch.setattr(hf, "pull", lambda *args: pulls.append(pull(*args)) or pulls[-1])
    blocks, hf_blocks = [], hf._hf_blocks
    monkeypatch.setattr(hf, "_hf_blocks", lambda *args: (blocks.append(b) or b for b in hf_blocks(*args)))
    hf.write_hf(tmp_path / "out", params, cfg, shard_bytes=16384, block_bytes=512)
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == files
    original, returned = hf_tensors(MODEL), hf_tensors(tmp_path / "out")
    assert sorted(p.size for p in pulls) == sorted(t.size for t in original.values())  # one tensor (layer) each
    assert max(b.nbytes for b in blocks) <= max(512, cfg.vocab_size * 4)  # a block, or one row
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        np.testing.assert_array_equal(returned[name], tensor, err_msg=name)


def test_interleaved_rotary_layout_round_trips_in_blocks(tmp_path):
    cfg, params = api.load(f"hf:{MODEL}", overrides=LAYOUT)
    hf.write_hf(tmp_path / "meta", params, cfg, rotary="interleaved", block_bytes=64)
    assert not np.array_equal(
        hf_tensors(tmp_path / "meta")["model.layers.0.self_attn.q_proj.weight"],
        hf_tensors(MODEL)["model.layers.0.self_attn.q_proj.weight"],
    )
    back = hf.read_params(tmp_path / "meta", cfg, rotary="interleaved", block_bytes=64)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_readme_sharded_commands(with_tokenizer, tmp_path, monkeypatch, capsys):
    """The guide's commands for models too big for one device, on the golden model (4 heads: mesh.tensor=8
    becomes 4, and fsdp fills the other 2 of the 8 devices)."""
    from test_readme import llama_jax_args, readme_commands

    model, _ = with_tokenizer
    monkeypatch.chdir(tmp_path)
    commands = [c for verb in ("convert", "generate") for c in readme_commands(f"llama-jax {verb}") if "mesh." in c]
    assert len(commands) == 3
    for command in commands:
        args = [
            a.replace("/models/Llama-3.1-70B", str(model)).replace("mesh.tensor=8", "mesh.tensor=4")
            for a in llama_jax_args(command)
        ]
        assert cli.main(args) == 0, (command, capsys.readouterr().err)
    assert "\nThe capital of France is" in capsys.readouterr().out
    assert (tmp_path / "runs" / "llama3-70b" / "checkpoints" / "0" / "params").is_dir()
    assert {str(t.dtype) for t in hf_tensors(tmp_path / "exported" / "llama3-70b-hf").values()} == {"bfloat16"}


def test_a_mesh_the_model_does_not_fit_exits_2_with_one_line(with_tokenizer, capsys):
    model, _ = with_tokenizer
    assert cli.main(["generate", f"hf:{model}", "mesh.tensor=8", "--prompt", "x"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "model.n_heads (4) and model.n_kv_heads (2) do not fit mesh.tensor (8)" in err


def test_key_value_overrides_may_follow_options_but_unknown_options_are_refused(capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["convert", "a", "b", "--dtype", "bfloat16", "--bogus", "mesh.tensor=2"])
    assert exit_.value.code == 2 and "unrecognized arguments: --bogus" in capsys.readouterr().err


def test_a_tensor_of_another_shape_than_config_json_says_exits_2_with_one_line(tmp_path, capsys):
    shutil.copytree(MODEL, tmp_path / "model")
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    (tmp_path / "model" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    assert cli.main(["convert", str(tmp_path / "model"), str(tmp_path / "out"), *LAYOUT]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "model.layers.0.mlp.gate_proj.weight has shape [64, 32] but config.json implies [48, 32]" in err
    assert not (tmp_path / "out").exists()


SCRIPT = """import json, os, sys
import jax
from llama_jax import api
from llama_jax.inference.generate import generate
_, source, out, back, *overrides = sys.argv[1:]  # argv[1] is the launcher's command name
api.convert(source, out, overrides, print_fn=lambda _: None)
api.convert(out, back, overrides, dtype="bfloat16", print_fn=lambda _: None)
cfg, params = api.load(out, overrides=overrides)
tokens = generate(cfg, params, json.loads(os.environ["PROMPTS"]), 6, jax.random.key(0))
if jax.process_index() == 0:
    print("TOKENS", json.dumps([[int(t) for t in row] for row in tokens]))
"""


@pytest.mark.slow
def test_two_processes_convert_both_ways_and_generate_like_one(one_device, tmp_path):
    """2 processes x 4 devices (launch/multiprocess.py): each reads its own shards, process 0 alone writes the
    Hugging Face files, and the results are those of one process."""
    _, _, prompts, _ = one_device
    script = tmp_path / "convert.py"
    script.write_text(SCRIPT)
    env = dict(subprocess_environment(), LLAMA_JAX=f"{sys.executable} {script}", PROMPTS=json.dumps(prompts[:2]))
    args = [f"hf:{MODEL}", str(tmp_path / "ours"), str(tmp_path / "back"), *LAYOUT]
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "launch" / "multiprocess.py"),
            "--processes",
            "2",
            "--devices",
            "4",
            "--",
            "train",
            *args,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    tokens = json.loads(proc.stdout.split("TOKENS", 1)[1])
    cfg, params = api.load(f"hf:{MODEL}")
    assert tokens == generate(cfg, params, prompts[:2], 6, jax.random.key(0))
    original, returned = hf_tensors(MODEL), hf_tensors(tmp_path / "back")
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        np.testing.assert_array_equal(
            returned[name].astype(np.float32), tensor.astype("bfloat16").astype(np.float32), err_msg=name
        )


def test_convert_memory_benchmark_runs_on_a_small_model(tmp_path):
    """bench/convert_memory.py end to end on a 1 MB model (the figures themselves: docs in the script)."""
    out = tmp_path / "figures.json"
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "convert_memory.py"),
            "--layers",
            "2",
            "--d-model",
            "64",
            "--ffn",
            "128",
            "--vocab",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--devices",
            "2",
            "--mesh",
            "mesh.tensor=2",
            "--json",
            str(out),
        ],
        env=dict(os.environ, XLA_FLAGS=""),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures["model_bytes"] == 4 * (2 * 256 * 64 + 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128 + 2 * 64) + 64)
    assert all(
        figures[step]["peak_rss_bytes"] > figures["baseline"]["peak_rss_bytes"] / 2 for step in ("import", "export")
    )
    assert "held by the conversion" in proc.stdout
