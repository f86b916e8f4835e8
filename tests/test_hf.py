"""Hugging Face interop: parity with transformers' LlamaForCausalLM, conversion both ways, generation.

The goldens in tests/golden/hf were made by tests/golden/make_hf_golden.py with transformers' PyTorch
model on the CPU; the last test repeats the comparison live when transformers is installed.
"""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import COMPILE_FLAGS
from safetensors.numpy import load_file

from llama_jax import api, cli
from llama_jax.inference.generate import GREEDY, Sampling, generate, generate_without_cache
from llama_jax.interop import hf, hf_config, hf_tensor_map

GOLDEN = Path(__file__).parent / "golden" / "hf"
MODELS = sorted(p.name for p in GOLDEN.iterdir() if (p / "golden.npz").is_file())
TOLERANCE = 1e-4  # max |logits difference| in fp32, the bar


@pytest.fixture(scope="module", params=MODELS)
def golden(request):
    directory = GOLDEN / request.param
    cfg, params = api.load(f"hf:{directory}")
    return directory, cfg, params, dict(np.load(directory / "golden.npz"))


def test_logits_match_transformers(golden):
    _, cfg, params, expected = golden
    ours = api.logits(cfg, params, expected["tokens"])
    assert ours.shape == expected["logits"].shape
    assert np.abs(ours - expected["logits"]).max() <= TOLERANCE


def test_greedy_generation_with_and_without_cache_matches_transformers(golden):
    _, cfg, params, expected = golden
    prompt, rng = expected["prompt"].tolist(), jax.random.key(0)
    (cached,) = generate(cfg, params, [prompt], 12, rng, GREEDY)
    uncached = generate_without_cache(cfg, params, prompt, 12, rng, GREEDY)
    assert cached == uncached == expected["generated"].tolist()


def test_batched_prompts_of_different_lengths_decode_like_single_prompts(golden):
    _, cfg, params, expected = golden
    prompts = [expected["tokens"][0, :3].tolist(), expected["tokens"][1, :9].tolist(), expected["prompt"].tolist()]
    rng = jax.random.key(0)
    batched = generate(cfg, params, prompts, 8, rng, GREEDY)
    assert batched == [generate(cfg, params, [p], 8, rng, GREEDY)[0] for p in prompts]


def test_sampling_is_seeded_and_respects_top_k(golden):
    _, cfg, params, expected = golden
    prompt, sampling = [expected["prompt"].tolist()], Sampling(temperature=1.0, top_k=1)
    assert generate(cfg, params, prompt, 6, jax.random.key(1), sampling) == generate(
        cfg, params, prompt, 6, jax.random.key(2), GREEDY
    )  # top-1 sampling is greedy
    hot = Sampling(temperature=1.5, top_p=0.9)
    assert generate(cfg, params, prompt, 6, jax.random.key(3), hot) == generate(
        cfg, params, prompt, 6, jax.random.key(3), hot
    )


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


def test_hf_to_ours_to_hf_reproduces_every_tensor_exactly(golden, tmp_path):
    directory, cfg, _, _ = golden
    ours, back = tmp_path / "ours", tmp_path / "back"
    api.convert(f"hf:{directory}", str(ours), print_fn=lambda _: None)
    api.convert(str(ours), str(back), dtype="float32", print_fn=lambda _: None)
    original, returned = hf_tensors(directory), hf_tensors(back)
    assert sorted(original) == sorted(returned)
    for name, tensor in original.items():
        np.testing.assert_array_equal(returned[name], tensor, err_msg=name)
    assert hf_config.read_config(back) == hf_config.read_config(directory)


def test_a_bfloat16_export_loads_with_the_same_logits_within_bfloat16_rounding(golden, tmp_path):
    directory, cfg, params, expected = golden
    api.convert(f"hf:{directory}", str(tmp_path / "ours"), print_fn=lambda _: None)
    api.convert(str(tmp_path / "ours"), str(tmp_path / "bf16"), dtype="bfloat16", print_fn=lambda _: None)
    assert {str(t.dtype) for t in hf_tensors(tmp_path / "bf16").values()} == {"bfloat16"}
    cfg16, params16 = api.load(f"hf:{tmp_path / 'bf16'}")
    rounded = jax.tree.map(lambda x: np.asarray(x).astype("bfloat16").astype(np.float32), params)
    np.testing.assert_array_equal(
        api.logits(cfg16, params16, expected["tokens"]), api.logits(cfg, rounded, expected["tokens"])
    )


def test_both_config_formats_read_the_same(tmp_path):
    source = json.loads((GOLDEN / "gqa_llama3_untied" / "config.json").read_text())
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    common = {k: v for k, v in source.items() if k not in ("rope_theta", "rope_scaling", "rope_parameters")}
    old = {**common, "rope_theta": 500000.0, "rope_scaling": rope}  # transformers 4.x
    new = {**common, "rope_parameters": {**rope, "rope_theta": 500000.0}}  # transformers 5.x
    configs = []
    for name, config in (("v4", old), ("v5", new)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(config))
        configs.append(hf_config.read_config(tmp_path / name))
    assert configs[0] == configs[1]
    assert configs[0].rope_scaling_factor == 8.0 and configs[0].rope_original_max_len == 16
    assert configs[0].rope_theta == 500000.0


def test_interleaved_rotary_layout_is_converted(golden, tmp_path):
    """Meta's original layout: q/k rows interleaved per head. Read with rotary=interleaved, it is the same model."""
    directory, cfg, _, expected = golden
    meta_layout = tmp_path / "meta"
    shutil.copytree(directory, meta_layout)
    for file in meta_layout.glob("*.safetensors"):
        tensors = load_file(file)
        for name in tensors:
            heads = cfg.n_heads if name.endswith("q_proj.weight") else cfg.n_kv_heads
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                tensors[name] = hf_tensor_map.half_to_interleaved(tensors[name], heads)
        from safetensors.numpy import save_file

        save_file(tensors, file, metadata={"format": "pt"})
    params = hf.read_params(meta_layout, cfg, rotary="interleaved")
    assert np.abs(api.logits(cfg, params, expected["tokens"]) - expected["logits"]).max() <= TOLERANCE
    w = np.arange(4 * 8 * 3, dtype=np.float32).reshape(4 * 8, 3)
    np.testing.assert_array_equal(hf_tensor_map.interleaved_to_half(hf_tensor_map.half_to_interleaved(w, 4), 4), w)


@pytest.mark.parametrize(
    "damage, message",
    [
        ("architecture", "architecture MistralForCausalLM is not supported"),
        ("missing-tensor", "lacks tensor(s) model.layers.1.mlp.up_proj.weight"),
        ("rope-type", "rope type 'yarn' is not supported"),
    ],
)
def test_unsupported_or_incomplete_models_exit_2_naming_what(damage, message, tmp_path, capsys):
    source = tmp_path / "model"
    shutil.copytree(GOLDEN / "gqa_llama3_untied", source)
    config = json.loads((source / "config.json").read_text())
    if damage == "architecture":
        config.update(architectures=["MistralForCausalLM"], model_type="mistral")
    elif damage == "rope-type":
        config["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
        config.pop("rope_parameters", None)
    else:
        from safetensors.numpy import save_file

        tensors = load_file(source / "model.safetensors")
        del tensors["model.layers.1.mlp.up_proj.weight"]
        save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    (source / "config.json").write_text(json.dumps(config))
    assert cli.main(["convert", str(source), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert not (tmp_path / "out").exists()


def test_convert_refuses_to_overwrite(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    assert cli.main(["convert", f"hf:{GOLDEN / 'tied_head_dim'}", str(tmp_path / "out")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_live_parity_with_transformers(tmp_path):
    """When transformers and torch are installed: make a fresh random model and compare now."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_hf_golden", GOLDEN.parent / "make_hf_golden.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    for name, fields in maker.MODELS.items():
        maker.make(tmp_path, name, fields)
        cfg, params = api.load(f"hf:{tmp_path / name}")
        expected = np.load(tmp_path / name / "golden.npz")
        assert np.abs(api.logits(cfg, params, expected["tokens"]) - expected["logits"]).max() <= TOLERANCE
        (ours,) = generate(cfg, params, [expected["prompt"].tolist()], 12, jax.random.key(0), GREEDY)
        assert ours == expected["generated"].tolist()


def test_generate_and_eval_commands_on_a_converted_model(tmp_path, capsys):
    """The CLI end to end on a converted golden model with a byte-level tokenizer of its vocabulary."""
    from llama_jax.data.tokenizer import train_bpe

    ours = tmp_path / "ours"
    api.convert(f"hf:{GOLDEN / 'gqa_llama3_untied'}", str(ours), print_fn=lambda _: None)
    words = "the quick brown fox jumps over the lazy dog while the cat sleeps".split()
    texts = [" ".join(words[i:] + words[:i]) for i in range(len(words))] * 20
    train_bpe(texts, 300).save(ours)
    (tmp_path / "text.txt").write_text("\n".join(texts))
    assert (
        cli.main(
            [
                "generate",
                str(ours),
                "--prompt",
                "the quick",
                "--prompt",
                "a lazy dog",
                "--max-new-tokens",
                "5",
                "--temperature",
                "0",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("the quick") and "a lazy dog" in out
    assert (
        cli.main(
            ["eval", str(ours), str(tmp_path / "text.txt"), "train.batch_size=8", "train.seq_len=16", "--batches", "2"]
        )
        == 0
    )
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "perplexity" in line and "(2 batch(es) of 8 x 16 tokens)" in line
    # eval reads the field and the unit of text it is given: data.text_field, data.text_unit
    (tmp_path / "texts.jsonl").write_text("\n".join(json.dumps({"body": t}) for t in texts) + "\n")
    assert (
        cli.main(
            [
                "eval",
                str(ours),
                str(tmp_path / "texts.jsonl"),
                "train.batch_size=8",
                "train.seq_len=16",
                "data.text_field=body",
                "--batches",
                "2",
            ]
        )
        == 0
    )
    assert "(2 batch(es) of 8 x 16 tokens)" in capsys.readouterr().out
    whole, lines = (
        api.evaluate(
            str(ours),
            str(tmp_path / "text.txt"),
            ["train.batch_size=8", "train.seq_len=16", *unit],
            print_fn=lambda _: None,
        )
        for unit in ([], ["data.text_unit=line"])
    )
    assert lines["batches"] > whole["batches"]  # a document per line: BOS and EOS around every line


def test_a_checkpoint_trained_with_sharding_converts_and_evaluates_on_one_device(tmp_path, corpus, tiny):
    from llama_jax.training.loop import train

    cfg = tiny(
        tmp_path,
        train=dict(steps=3),
        mesh=dict(fsdp=8),
        data=dict(sources=[str(corpus)]),
        checkpoint=dict(every_steps=0),
    )
    train(cfg, print_fn=lambda _: None)
    exported = tmp_path / "hf"
    api.convert(cfg.run.dir, str(exported), print_fn=lambda _: None)
    assert (exported / "tokenizer.json").is_file()
    tokens = np.arange(2 * 16).reshape(2, 16) % cfg.model.vocab_size
    run_cfg, run_params = api.load(cfg.run.dir)  # on one device
    hf_cfg, hf_params = api.load(f"hf:{exported}")
    assert hf_cfg == dataclasses.replace(run_cfg, init_std=hf_cfg.init_std, attention=hf_cfg.attention)
    np.testing.assert_array_equal(api.logits(hf_cfg, hf_params, tokens), api.logits(run_cfg, run_params, tokens))
    one_device = api.evaluate(
        f"hf:{exported}",
        str(corpus),
        ["mesh.fsdp=1", "train.batch_size=2", "train.seq_len=16", "model.compute_dtype=float32"],
        max_batches=2,
        print_fn=lambda _: None,
        devices=jax.devices()[:1],
    )
    assert np.isfinite(one_device["loss"]) and one_device["perplexity"] > 1


def test_init_from_hf_trains_from_those_weights(tmp_path, corpus, tiny):
    from llama_jax.training.loop import train

    source = GOLDEN / "gqa_llama3_untied"  # its vocabulary (300) holds a byte-level BPE (>= 258)
    model = dataclasses.replace(hf_config.read_config(source), compute_dtype="float32", max_seq_len=128)
    cfg = tiny(
        tmp_path,
        model=dataclasses.asdict(model),
        train=dict(steps=1, lr=1e-9, weight_decay=0.0),
        data=dict(sources=[str(corpus)]),
        checkpoint=dict(init_from=f"hf:{source}"),
    )
    messages = []
    train(cfg, print_fn=messages.append)
    assert f"initialised the params from hf:{source}" in messages
    _, trained = api.load(cfg.run.dir)
    _, original = api.load(f"hf:{source}")
    for a, b in zip(jax.tree.leaves(trained), jax.tree.leaves(original)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-7)  # one step at lr 1e-9


def test_colab_notebook_runs_on_every_device(tmp_path, monkeypatch):
    """examples/colab.ipynb executed cell by cell in a fresh kernel on 8 simulated CPU devices (an 8-core TPU
    runtime, say; a few steps): the mesh takes every device the runtime has."""
    nbformat = pytest.importorskip("nbformat")
    from nbclient import NotebookClient

    notebook = nbformat.read(Path(__file__).resolve().parents[1] / "examples" / "colab.ipynb", as_version=4)
    monkeypatch.setenv("LLAMA_JAX_NOTEBOOK_STEPS", "6")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count=8 {COMPILE_FLAGS}")  # the suite's compiles
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(tmp_path)}}
    ).execute()
    outputs = ["".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in notebook.cells]
    assert "on 8 x cpu" in outputs[2] and "final_eval_loss" in outputs[3]
    assert any(
        o.get("output_type") == "display_data" and "image/png" in o.get("data", {}) for o in notebook.cells[4].outputs
    )
    assert outputs[5].count("---") == 2 and outputs[5].startswith("ROMEO:")


def test_readme_hugging_face_guide_commands(tmp_path, monkeypatch, corpus, tiny, capsys):
    """The guide's convert / generate / eval commands as shown, on a golden model and a short tiny run."""
    from test_readme import llama_jax_args, readme_commands

    from llama_jax.training.loop import train

    monkeypatch.chdir(tmp_path)
    cfg = tiny(tmp_path, train=dict(steps=2), data=dict(sources=[str(corpus)]), run=dict(dir="runs/tiny"))
    train(cfg, print_fn=lambda _: None)
    commands = [
        c
        for verb in ("convert", "generate", "eval")
        for c in readme_commands(f"llama-jax {verb}")
        if "mesh." not in c  # the sharded ones: test_inference.py; the adapter guide's: test_peft*.py
        and "--tasks" not in c  # lm-eval tasks: test_evaluation.py
        and not any(f" runs/{adapted} " in c for adapted in ("lora", "prompt", "ptuning"))
        and " /adapters/" not in c
    ]
    assert len(commands) == 4
    for command in commands:
        args = [
            a.replace("/models/Llama-3.2-1B", str(GOLDEN / "gqa_llama3_untied")).replace("path/to/texts/", str(corpus))
            for a in llama_jax_args(command)
        ]
        assert cli.main(args) == 0, (command, capsys.readouterr().err)
    assert (tmp_path / "exported" / "tiny-hf" / "model.safetensors").is_file()
    assert (tmp_path / "runs" / "llama3-1b" / "checkpoints" / "0" / "params").is_dir()
