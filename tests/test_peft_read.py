"""Reading Hugging Face PEFT adapters: an adapter made by the peft library (tests/golden/peft/peft_made_*, from
tests/golden/make_peft_golden.py; live where torch and peft are installed) loads onto a base model wherever a model
spec is taken (ADAPTER@BASE) and gives PEFT's logits; our adapters come back bit for bit; a peft run continues an
adapter's training; what our LoRA does not compute is refused in one line."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file
from test_peft import ALL_TARGETS, GOLDEN, HF_BASE, TOLERANCE, adapter_config, golden_maker

from llama_jax import api, cli
from llama_jax.checkpoint import specs
from llama_jax.config import PeftConfig
from llama_jax.data.tokenizer import train_bpe
from llama_jax.errors import ConfigError
from llama_jax.interop import peft_format
from llama_jax.training.loop import train

PEFT_MADE = ["peft_made_lora", "peft_made_rslora_bf16"]  # fp32 on every projection; bf16, rsLoRA, three targets
BASE = f"hf:{HF_BASE}"


def golden_logits(name: str) -> np.ndarray:
    return np.load(GOLDEN / name / "golden.npz")["logits"]


@pytest.fixture
def adapter(tmp_path):
    """A copy of the fp32 PEFT-made adapter with a tokenizer beside it (PEFT saves one there when given)."""
    directory = tmp_path / "adapter"
    shutil.copytree(GOLDEN / "peft_made_lora", directory)
    train_bpe(["to be or not to be, that is the question"] * 20, 300).save(directory)
    return directory


@pytest.mark.parametrize("name", PEFT_MADE)
def test_an_adapter_peft_made_gives_pefts_logits_on_its_base(name):
    cfg, params = api.load(f"{GOLDEN / name}@{BASE}")
    tokens = np.load(GOLDEN / name / "golden.npz")["tokens"]
    assert np.abs(api.logits(cfg, params, tokens) - golden_logits(name)).max() <= TOLERANCE
    _, base = api.load(BASE)  # and the adapter did change the model
    assert np.abs(api.logits(cfg, base, tokens) - golden_logits(name)).max() > 100 * TOLERANCE


def test_live_an_adapter_peft_makes_now_gives_its_logits(tmp_path):
    """Where torch and peft are installed: an adapter PEFT makes in this run, read by us."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    maker = golden_maker()
    for name in maker.PEFT_MADE:
        maker.make_with_peft(name, tmp_path / name)
        cfg, params = api.load(f"{tmp_path / name}@{BASE}")
        assert np.abs(api.logits(cfg, params, maker.tokens()) - maker.peft_logits(tmp_path / name)).max() <= TOLERANCE


def test_tensor_names_without_pefts_prefix_read_the_same(adapter):
    """Some tools save PEFT adapters without `base_model.model.` in front of the names."""
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file(
        {k.removeprefix(peft_format.LORA_PREFIX): v for k, v in tensors.items()}, adapter / "adapter_model.safetensors"
    )
    _, with_prefix = api.load(f"{GOLDEN / 'peft_made_lora'}@{BASE}")
    _, without = api.load(f"{adapter}@{BASE}")
    for a, b in zip(jax.tree.leaves(with_prefix), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("lora_all_targets", "float32"),
        ("lora_all_targets", "bfloat16"),
        ("lora_all_targets", "float16"),
        ("prompt_tuning", "float32"),
    ],
)
def test_our_adapters_written_then_read_back_are_bitwise_the_same(name, dtype, tmp_path):
    """Ours -> PEFT's format (in dtype) -> read: identical to the adapters rounded to dtype once."""
    cfg, settings, adapters = golden_maker().adapters(name)
    peft_format.write_adapter(tmp_path, adapters, cfg, settings, str(HF_BASE), dtype)
    spec = specs.resolve(str(tmp_path))  # alone: adapter_config.json names the base, a directory here
    assert spec.adapters == settings and spec.base["path"] == f"hf:{HF_BASE.absolute()}"
    read = specs.load_adapters(spec)
    rounded = jax.tree.map(lambda x: np.asarray(x).astype(dtype).astype(np.float32), adapters)
    for a, b in zip(jax.tree.leaves(rounded), jax.tree.leaves(read), strict=True):
        np.testing.assert_array_equal(a, np.asarray(b))


def test_the_guides_commands_on_an_adapter_made_by_peft(adapter, tmp_path, corpus, monkeypatch, capsys):
    """docs/peft.md's generate / eval / convert --merge on an adapter trained elsewhere, as shown: the merged
    Hugging Face export computes PEFT's logits; converting the adapter back (no --merge) rewrites it as it was."""
    from test_readme import llama_jax_args, readme_commands

    monkeypatch.chdir(tmp_path)
    commands = [c for verb in ("generate", "eval", "convert") for c in readme_commands(f"llama-jax {verb} /adapters/")]
    assert len(commands) == 3
    for command in commands:
        args = [
            a.replace("/adapters/my-lora", str(adapter))
            .replace("/models/Llama-3.2-1B", str(HF_BASE))
            .replace("path/to/texts/", str(corpus))
            for a in llama_jax_args(command)
        ]
        assert cli.main(args) == 0, (command, capsys.readouterr().err)
    assert "perplexity" in capsys.readouterr().out
    assert (tmp_path / "exported" / "my-lora-merged" / "tokenizer.json").is_file()  # the adapter's went along
    cfg, merged = api.load(f"hf:{tmp_path / 'exported' / 'my-lora-merged'}")
    tokens = np.load(GOLDEN / "peft_made_lora" / "golden.npz")["tokens"]
    assert np.abs(api.logits(cfg, merged, tokens) - golden_logits("peft_made_lora")).max() <= TOLERANCE
    assert cli.main(["convert", f"{adapter}@{BASE}", "again"]) == 0
    original, again = (load_file(d / "adapter_model.safetensors") for d in (adapter, tmp_path / "again"))
    assert sorted(original) == sorted(again)
    for key in original:
        np.testing.assert_array_equal(original[key], again[key], err_msg=key)


def test_a_peft_run_continues_training_an_adapter(tmp_path, corpus):
    """checkpoint.init_from=ADAPTER@BASE with the adapter's peft.* settings: the run adapts its base and starts
    from its adapters, so its first eval loss is the adapted model's, the loss of a full fine-tuning run
    initialised from the merged weights (and not the base's, where new adapters start); then it trains."""
    lora = dict(method="lora", rank=4, alpha=8.0, targets=ALL_TARGETS)
    spec = f"{GOLDEN / 'peft_made_lora'}@{BASE}"

    def first_eval_loss(name, settings, init_from, steps=0):
        cfg = adapter_config(tmp_path, corpus, name, settings, checkpoint=dict(init_from=init_from))
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, steps=steps))
        messages = []
        summary = train(cfg, print_fn=messages.append, devices=jax.devices()[:2])
        return summary, messages

    continued, messages = first_eval_loss("continued", lora, spec, steps=2)
    assert f"continuing the adapters of {spec}" in messages and continued["exit_code"] == 0
    merged, _ = first_eval_loss("merged", {}, spec)
    fresh, _ = first_eval_loss("fresh", lora, BASE)
    assert abs(continued["initial_eval_loss"] - merged["initial_eval_loss"]) <= 1e-5 * merged["initial_eval_loss"]
    assert abs(continued["initial_eval_loss"] - fresh["initial_eval_loss"]) > 1e-3
    assert continued["final_eval_loss"] < continued["initial_eval_loss"]


def test_continuing_an_adapter_with_other_peft_settings_says_which_to_set(tmp_path, capsys):
    config = tmp_path / "config.yaml"
    model = dataclasses.asdict(specs.resolve(BASE).model)
    config.write_text(json.dumps({"model": model}))
    args = [
        "train",
        str(config),
        f"run.dir={tmp_path / 'run'}",
        "peft.method=lora",
        "peft.rank=8",
        f"checkpoint.init_from={GOLDEN / 'peft_made_rslora_bf16'}@{BASE}",
    ]
    assert cli.main(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert (
        "holds adapters with other settings than peft.*; to continue training them set peft.rank=2 "
        "peft.alpha=4.242640687119286 peft.targets=[q,v,down]" in line
    ), line
    assert not (tmp_path / "run").exists()


def edited(adapter: Path, **changes) -> Path:
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return adapter


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(use_dora=True), "uses DoRA (use_dora: true), which llama-jax's LoRA does not compute"),
        (dict(bias="lora_only"), "uses trained biases (bias: lora_only)"),
        (dict(rank_pattern={"q_proj": 8}), "uses per-module ranks (rank_pattern)"),
        (dict(layers_to_transform=[0]), "uses adapters on some layers only (layers_to_transform)"),
        (dict(modules_to_save=["lm_head"]), "uses fully trained modules (modules_to_save: ['lm_head'])"),
        (dict(peft_type="IA3"), "holds a PEFT adapter of type IA3; llama-jax reads LORA and PROMPT_TUNING"),
        (dict(r=8), "has shape [4, 32] where a rank-8 LoRA on this base model has [8, 32]"),
        (
            dict(base_model_name_or_path="meta-llama/Llama-3.2-1B"),
            "adapts meta-llama/Llama-3.2-1B, which is not a model on this machine; name the base: ",
        ),
    ],
)
def test_an_adapter_we_cannot_compute_the_same_way_is_one_line_exit_2(change, message, adapter, tmp_path, capsys):
    edited(adapter, **change)
    spec = str(adapter) if "base_model_name_or_path" in change else f"{adapter}@{BASE}"
    assert cli.main(["convert", spec, str(tmp_path / "out"), "--merge"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert message in line, line
    assert not (tmp_path / "out").exists()


def test_an_adapter_for_another_base_or_with_other_tensors_is_refused(adapter, tmp_path):
    other = tmp_path / "other-base"  # a base of 3 layers: the adapter covers only 2
    shutil.copytree(GOLDEN.parent / "hf" / "mha_sharded_files", other)
    with pytest.raises(ConfigError, match="on layers 0-1 but the base model has 3 layers: the adapter was made for"):
        specs.resolve(f"{adapter}@hf:{other}")
    tensors = load_file(adapter / "adapter_model.safetensors")
    tensors["base_model.model.model.embed_tokens.lora_embedding_A"] = np.zeros((4, 300), np.float32)
    save_file(tensors, adapter / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="is not the LoRA A or B of a Llama projection"):
        specs.resolve(f"{adapter}@{BASE}")
    with pytest.raises(ConfigError, match="is not a PEFT adapter directory"):
        specs.resolve(f"{tmp_path / 'nothing'}@{BASE}")


def test_the_adapter_settings_read_are_the_ones_peft_wrote():
    settings = specs.resolve(f"{GOLDEN / 'peft_made_rslora_bf16'}@{BASE}").adapters
    assert settings == PeftConfig(method="lora", rank=2, alpha=3 * 2**0.5, targets=["q", "v", "down"])
