"""Parameter-efficient tuning: LoRA, prompt tuning and P-tuning on a frozen base, their checkpoints and
fault tolerance, PEFT-format export checked against Hugging Face PEFT, and bad input.

The goldens in tests/golden/peft were made by tests/golden/make_peft_golden.py: adapters written by our
exporter, loaded by PEFT onto transformers' Llama; the live test repeats that where torch and peft are installed.
"""

import dataclasses
import functools
import importlib.util
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import TINY_MODEL, forward, tiny_config
from safetensors.numpy import load_file, save_file
from test_fault import corrupt
from test_train import random_batch, relative_difference

from llama_jax import api, cli
from llama_jax.checkpoint import specs
from llama_jax.config import PeftConfig, RematConfig, load_config, to_yaml
from llama_jax.config.choices import REMAT_POLICIES
from llama_jax.data.loader import Documents, PackedRows, model_inputs
from llama_jax.distributed import sharding
from llama_jax.interop import hf_config
from llama_jax.model import peft
from llama_jax.model.llama import abstract_model, param_shapes
from llama_jax.training.batches import abstract_batch, put_batch
from llama_jax.training.loop import train
from llama_jax.training.program import TrainProgram
from llama_jax.training.run import load_checkpoint

GOLDEN = Path(__file__).parent / "golden" / "peft"
ALL_TARGETS = ["q", "k", "v", "o", "gate", "up", "down"]
LORA = PeftConfig(method="lora", rank=4, alpha=8.0, targets=ALL_TARGETS)
TOLERANCE = 1e-4  # max |logits difference| against PEFT in fp32, the bar (as tests/test_hf.py)
MERGE_TOLERANCE = 1e-5  # merged weights against the adapters they fold, fp32


def quiet(_):
    pass


def random_params(cfg, settings=PeftConfig(), seed=0, zero_lora_b=False):
    """Params of the model of cfg (with peft=settings) drawn with numpy (no compilation): normal, std 0.05 (norm scales
    around 1); LoRA's B zero if asked, as the model initialises it."""
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        names = [getattr(key, "key", "") for key in path]
        if names[-1] == "lora_b" and zero_lora_b:
            return np.zeros(leaf.shape, np.float32)
        return (float(names[-1] == "scale") + 0.05 * rng.standard_normal(leaf.shape)).astype(np.float32)

    return jax.tree_util.tree_map_with_path(draw, param_shapes(cfg, settings))


@pytest.fixture(scope="module")
def base_params():
    return random_params(TINY_MODEL)


def grafted(cfg, settings, base, seed=1, zero_lora_b=False):
    """The params of the model of cfg with peft=settings: `base`'s weights and random adapters."""
    return peft.merge(peft.split(random_params(cfg, settings, seed, zero_lora_b))[0], base)


# ---------------------------------------------------------------------------------------------
# The model with adapters


def test_lora_starts_as_the_base_model_bitwise_and_recomputing_layers_changes_no_gradient(base_params):
    """Step 0 (B zero) gives the base model's logits bit for bit; the adapters' gradients (at B away from
    zero) are the same with every second layer recomputing (remat.every_n_layers, its own path through the
    layers) as with every activation kept."""
    batch = random_batch(tiny_config(), seq=16)
    adapters, base = peft.split(grafted(TINY_MODEL, LORA, base_params, zero_lora_b=True))
    plain = abstract_model(TINY_MODEL)
    expected = jax.jit(lambda params: forward(plain, params, batch["tokens"]))(base_params)

    def logits_and_gradients(remat):
        model = abstract_model(TINY_MODEL, remat_config=remat, peft=LORA)

        def loss(a):
            return forward(
                model,
                peft.merge(a, base),
                batch["tokens"],
                batch["positions"],
                batch["segment_ids"],
                targets=batch["targets"],
                loss_mask=batch["loss_mask"],
            )[0]

        def run(a):
            moved = jax.tree.map(lambda x: x + 0.01, a)  # every gradient informative
            return forward(model, peft.merge(a, base), batch["tokens"]), jax.grad(loss)(moved)

        return jax.jit(run)(adapters)

    logits, kept = logits_and_gradients(RematConfig())
    np.testing.assert_array_equal(np.asarray(logits), np.asarray(expected))
    # fp32: the same sums in another order (the bound test_train.py puts on micro-batch accumulation)
    assert relative_difference(logits_and_gradients(RematConfig(policy="full", every_n_layers=2))[1], kept) < 1e-5


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_every_remat_policy_keeps_its_tags_and_nothing_of_the_adapters(policy, monkeypatch):
    """Each policy keeps for the backward pass what it keeps without adapters; LoRA's own intermediates
    (x A) carry no tag and are recomputed. (Numbers under remat: the mesh test below.)"""
    from test_remat import saved_residuals

    from llama_jax.model import remat

    monkeypatch.setattr(remat, "host_offload_supported", lambda: True)
    assert saved_residuals(RematConfig(policy=policy), LORA) == saved_residuals(RematConfig(policy=policy))


def test_the_adapters_carry_logical_names_and_shard_with_the_projection_they_adapt():
    cfg = tiny_config(peft=dataclasses.asdict(LORA), checkpoint=dict(init_from="x"), mesh=dict(fsdp=2, tensor=4))
    shardings = TrainProgram.for_config(cfg).state_shardings
    spec = lambda part, *path: tuple(functools.reduce(dict.get, path, getattr(shardings, part)).spec)  # noqa: E731
    q, down = ("params", "layers", "attn", "q_proj"), ("params", "layers", "mlp", "down_proj")
    # (the layers axis goes to the pipeline's stages, here one)
    assert spec(*q, "lora_a") == ("pipeline", "fsdp", None) and spec(*q, "lora_b") == ("pipeline", None, "tensor", None)
    assert spec(*down, "lora_a") == ("pipeline", "tensor", None) and spec(*down, "lora_b") == ("pipeline", None, "fsdp")
    assert spec("frozen", "layers", "attn", "q_proj", "kernel") == ("pipeline", "fsdp", "tensor", None)
    assert tuple(shardings.opt_state[1][0].mu["layers"]["attn"]["q_proj"]["lora_b"].spec) == spec(*q, "lora_b")
    assert "kernel" not in shardings.params["layers"]["attn"]["q_proj"]  # the base is frozen: no moments


def test_a_lora_step_computes_no_weight_gradient_of_the_base_and_leaves_it_bitwise_unchanged():
    """Backward through the frozen projections yields input gradients only: a third less work than full
    training (the lowered step's FLOPs; compiled, XLA keeps the same ratio: 68.4M / 101.7M here). Steps,
    a skipped non-finite one among them, change the adapters and leave the base's bits alone."""
    flops = {}
    for method in ("none", "lora"):
        cfg = tiny_config(
            peft=dict(method=method, rank=1, targets=["q"]),
            checkpoint=dict(init_from="x"),
            mesh=dict(fsdp=1),
            train=dict(lr=1e-2),
        )
        program = TrainProgram.build(cfg, sharding.make_mesh(cfg, devices=jax.devices()[:1]))
        with program.activate():
            flops[method] = program.train_step.lower(program.abstract_state(), abstract_batch(program)).cost_analysis()[
                "flops"
            ]
    assert flops["lora"] < 0.75 * flops["none"]
    with program.activate():  # the LoRA program
        state = program.init_state(jax.random.key(0))
        base, adapters = (jax.tree.map(np.asarray, tree) for tree in (state.frozen, state.params))
        for step in range(3):
            batch = {k: np.array(v) for k, v in random_batch(cfg, seed=step).items()}
            batch["loss_mask"][:] = np.nan if step == 1 else batch["loss_mask"]
            state, metrics = program.train_step(state, put_batch(program, batch))
            assert bool(metrics["finite"]) == (step != 1)
    for before, after in zip(jax.tree.leaves(base), jax.tree.leaves(state.frozen)):
        np.testing.assert_array_equal(np.asarray(after), before)
    assert not np.array_equal(
        np.asarray(state.params["layers"]["attn"]["q_proj"]["lora_b"]), adapters["layers"]["attn"]["q_proj"]["lora_b"]
    )


def test_lora_rank_8_on_bench_keeps_under_5_percent_of_full_fine_tunings_optimizer_state():
    def optimizer_bytes(overrides):
        program = TrainProgram.build(load_config("bench", overrides), sharding.make_mesh(load_config("bench")))
        return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(program.state_shapes.opt_state))

    full = optimizer_bytes([])
    lora = optimizer_bytes(
        ["peft.method=lora", "peft.rank=8", "peft.targets=[q,k,v,o,gate,up,down]", "checkpoint.init_from=runs/bench"]
    )
    assert 0 < lora <= 0.05 * full


def test_prompt_tuning_gives_each_packed_document_its_logits_alone(base_params):
    """Three documents packed by the loader, each behind its own prompt slots: the same logits as alone."""
    settings = PeftConfig(method="ptuning", prompt_tokens=3, prompt_encoder="lstm")
    params, model = grafted(TINY_MODEL, settings, base_params), abstract_model(TINY_MODEL, peft=settings)
    lengths = np.array([9, 13, 6])
    tokens = np.random.default_rng(1).integers(3, TINY_MODEL.vocab_size, lengths.sum()).astype(np.int32)
    docs = Documents.in_memory(np.split(tokens, np.cumsum(lengths)[:-1]))
    run = jax.jit(
        lambda inputs: forward(model, params, inputs["tokens"], inputs["positions"], inputs["segment_ids"])[0]
    )
    packed = PackedRows(docs, 3 * 3 + lengths.sum() + 1, 0, 0, "first_fit", 8, prompt_tokens=3)
    (row,) = [packed[r] for r in range(packed.rows_in_epoch(0))]  # all three in one row
    together = np.asarray(run(model_inputs([row])))
    for segment in (1, 2, 3):
        where = np.flatnonzero(row["segment_ids"] == segment)
        assert list(row["tokens"][where[:3]]) == [-1, -2, -3]
        assert list(row["positions"][where]) == list(range(len(where)))
        # The document alone, at the start of a row of the same length (padding after it: segment 0).
        alone = {k: np.zeros_like(v) for k, v in row.items()}
        for k in alone:
            alone[k][: len(where)] = row[k][where]
        np.testing.assert_allclose(
            together[where[:-1]], np.asarray(run(model_inputs([alone])))[: len(where) - 1], atol=1e-5
        )


# ---------------------------------------------------------------------------------------------
# Runs: a pre-trained base, adapted; checkpoints, fault tolerance, export


STEPS = 4
DEVICES = {"lora": jax.devices()[:4], "ptuning": jax.devices()[:1]}
HF_BASE = Path(__file__).parent / "golden" / "hf" / "gqa_llama3_untied"  # vocab 300: room for the corpus's BPE


def adapter_config(root, corpus, name, settings, **sections):
    """A run of `settings` adapting the Hugging Face golden model: 4 steps, a checkpoint every 2 (unless told)."""
    model = dataclasses.replace(hf_config.read_config(HF_BASE), compute_dtype="float32", max_seq_len=128)
    sections = {"checkpoint": dict(init_from=f"hf:{HF_BASE}", every_steps=2, keep=10), **sections}
    return tiny_config(
        root,
        model=dataclasses.asdict(model),
        peft=settings,
        data=dict(sources=[str(corpus)]),
        run=dict(dir=str(root / name)),
        train=dict(steps=STEPS, lr=1e-2, **sections.pop("train", {})),
        **sections,
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus):
    """Two runs adapting the Hugging Face golden model: LoRA on every projection with dropout, on a mesh of
    fsdp and tensor (4 devices), saving every step; P-tuning (MLP encoder, one device)
    with a NaN injected at its third step and fault.max_bad_steps=1, so it rolls back to step 2."""
    root = tmp_path_factory.mktemp("peft")
    lora = dict(method="lora", rank=4, targets=ALL_TARGETS, dropout=0.1)
    configs = {
        "lora": adapter_config(
            root,
            corpus,
            "lora",
            lora,
            checkpoint=dict(init_from=f"hf:{HF_BASE}", every_steps=1, keep=10),
            mesh=dict(fsdp=2, tensor=2),
        ),
        "ptuning": adapter_config(
            root,
            corpus,
            "ptuning",
            dict(method="ptuning", prompt_tokens=4),
            fault=dict(max_bad_steps=1),
            inject=dict(nan_steps=[2]),
        ),
    }
    messages = {name: [] for name in configs}
    summaries = {
        name: train(cfg, print_fn=messages[name].append, devices=DEVICES[name]) for name, cfg in configs.items()
    }
    return root, configs, messages, summaries


def test_a_run_adapts_its_base_and_checkpoints_hold_the_adapters_and_a_reference_to_it(runs):
    root, configs, messages, summaries = runs
    assert f"adapting hf:{HF_BASE} (peft.method=lora); its params stay frozen" in messages["lora"]
    assert summaries["lora"]["final_eval_loss"] < summaries["lora"]["initial_eval_loss"]
    state, _ = load_checkpoint(configs["lora"], STEPS, devices=DEVICES["lora"])
    names = {
        path[-1]
        for path in jax.tree_util.tree_flatten_with_path(state.params)[0]
        for path in [[getattr(k, "key", "") for k in path[0]]]
    }
    assert names == {"lora_a", "lora_b"}  # no base weight, and no optimizer moment of one
    meta = json.loads((root / "lora" / "checkpoints" / str(STEPS) / "meta" / "metadata").read_text())
    assert meta["base"]["path"] == f"hf:{HF_BASE.absolute()}"
    assert meta["base"]["digest"] == peft.digest(specs.load_params(specs.resolve(f"hf:{HF_BASE}")))


def test_p_tuning_rolls_back_past_a_bad_step(runs):
    _, _, messages, summaries = runs
    assert any("bad steps in a row: rolled back from step" in m and " to 2;" in m for m in messages["ptuning"]), (
        messages["ptuning"]
    )
    assert np.isfinite(summaries["ptuning"]["final_eval_loss"]) and summaries["ptuning"]["skipped_steps"] == 1


def test_resume_after_a_damaged_checkpoint_is_bitwise_the_straight_run(runs, tmp_path):
    """A copy of the LoRA run killed before its step 4 was saved, with step 3 damaged: it falls back to
    step 2 and trains on to the same adapters bit for bit (dropout masks included)."""
    root, configs, _, _ = runs
    shutil.copytree(root / "lora", tmp_path / "lora")
    shutil.rmtree(tmp_path / "lora" / "checkpoints" / str(STEPS))
    corrupt(tmp_path / "lora" / "checkpoints" / str(STEPS - 1), "truncated-array")
    cfg = dataclasses.replace(configs["lora"], run=dataclasses.replace(configs["lora"].run, dir=str(tmp_path / "lora")))
    messages = []
    train(cfg, print_fn=messages.append, devices=DEVICES["lora"])
    assert f"resumed from {tmp_path / 'lora' / 'checkpoints' / '2'}" in messages
    resumed, straight = (load_checkpoint(c, STEPS, devices=DEVICES["lora"])[0] for c in (cfg, configs["lora"]))
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_readme_adapter_guide_commands_on_lora_and_p_tuning_runs(runs, tmp_path, corpus, monkeypatch, capsys):
    """The guide's convert / generate / eval commands as shown, on runs/lora and runs/prompt (here P-tuning,
    which inference runs as prompt tuning); the merged export's logits are the adapted model's."""
    from test_readme import llama_jax_args, readme_commands

    root, _, _, _ = runs
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "lora").symlink_to(root / "lora")
    (tmp_path / "runs" / "prompt").symlink_to(root / "ptuning")
    commands = [
        c
        for verb in ("convert", "generate", "eval")
        for c in readme_commands(f"llama-jax {verb}")
        if any(f" runs/{adapted} " in c for adapted in ("lora", "prompt"))
    ]
    assert len(commands) == 4
    for command in commands:
        args = [a.replace("path/to/texts/", str(corpus)) for a in llama_jax_args(command)]
        assert cli.main(args) == 0, (command, capsys.readouterr().err)
    out = capsys.readouterr().out
    assert "HAMLET:" in out and "perplexity" in out
    assert json.loads((tmp_path / "exported" / "lora-adapter" / "adapter_config.json").read_text())["r"] == 4
    # The merged export (--merge) computes the adapted model's logits.
    spec = specs.resolve("runs/lora")
    adapters, base = specs.load_adapters(spec), specs.load_params(specs.resolve(f"hf:{HF_BASE}"))
    tokens = np.random.default_rng(0).integers(0, spec.model.vocab_size, (2, 24))
    model = abstract_model(spec.model, peft=spec.adapters)
    adapted = np.asarray(jax.jit(lambda p: forward(model, p, tokens))(peft.merge(adapters, base)))
    merged_cfg, merged = api.load(f"hf:{tmp_path / 'exported' / 'lora-merged'}")
    assert np.abs(api.logits(merged_cfg, merged, tokens) - adapted).max() <= MERGE_TOLERANCE
    assert np.abs(api.logits(merged_cfg, base, tokens) - adapted).max() > 100 * MERGE_TOLERANCE  # LoRA did change it
    # P-tuning's adapter: the prompt its encoder makes, as prompt tuning.
    assert cli.main(["convert", "runs/prompt", "exported/prompt-adapter"]) == 0
    config = json.loads((tmp_path / "exported" / "prompt-adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "PROMPT_TUNING" and config["num_virtual_tokens"] == 4
    _, params = api.load("runs/prompt")
    exported = load_file(tmp_path / "exported" / "prompt-adapter" / "adapter_model.safetensors")["prompt_embeddings"]
    np.testing.assert_array_equal(exported, np.asarray(params["prompt"]["embedding"]))


# ---------------------------------------------------------------------------------------------
# Hugging Face PEFT


@functools.cache
def golden_maker():
    spec = importlib.util.spec_from_file_location("make_peft_golden", GOLDEN.parent / "make_peft_golden.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker


@functools.cache
def our_logits(maker, name):
    """Our logits for the golden tokens with the adapters of `name`: [batch, (prompt +) seq, vocab]."""
    cfg, settings, adapters = maker.adapters(name)
    cfg, base = api.load(f"hf:{maker.BASE}")  # computing in fp32
    tokens = np.asarray(peft.with_prompt_slots(maker.tokens().tolist(), settings.virtual_tokens), np.int32)
    model = abstract_model(cfg, peft=settings)
    return np.asarray(jax.jit(lambda p: forward(model, p, tokens))(peft.merge(adapters, base)))


@pytest.mark.parametrize("name", ["lora_all_targets", "prompt_tuning"])
def test_adapters_we_write_are_the_goldens_peft_loaded_and_give_its_logits(name, tmp_path):
    maker = golden_maker()
    maker.write(name, tmp_path / name)
    assert json.loads((tmp_path / name / "adapter_config.json").read_text()) == json.loads(
        (GOLDEN / name / "adapter_config.json").read_text()
    )
    written, golden = (load_file(d / name / "adapter_model.safetensors") for d in (tmp_path, GOLDEN))
    assert sorted(written) == sorted(golden)
    for key in golden:
        np.testing.assert_array_equal(written[key], golden[key], err_msg=key)
    assert np.abs(our_logits(maker, name) - np.load(GOLDEN / name / "golden.npz")["logits"]).max() <= TOLERANCE


def test_live_parity_with_peft(tmp_path):
    """Where torch and peft are installed: PEFT loads the adapters we write now and computes our logits."""
    pytest.importorskip("torch")
    pytest.importorskip("peft")
    maker = golden_maker()
    for name in maker.ADAPTERS:
        maker.write(name, tmp_path / name)
        assert np.abs(maker.peft_logits(tmp_path / name) - our_logits(maker, name)).max() <= TOLERANCE


def test_folded_lora_gives_the_adapter_models_logits():
    maker = golden_maker()
    _, settings, adapters = maker.adapters("lora_all_targets")
    cfg, base = api.load(f"hf:{maker.BASE}")
    folded = peft.fold_lora(peft.merge(adapters, base), settings)
    assert (
        np.abs(api.logits(cfg, folded, maker.tokens()) - our_logits(maker, "lora_all_targets")).max() <= MERGE_TOLERANCE
    )


# ---------------------------------------------------------------------------------------------
# Bad input: one line, exit 2, nothing in run.dir touched


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["peft.method=lora", "peft.targets=[q,qkv]"],
            "peft.targets: unknown target 'qkv'; choose from q, k, v, o, gate",
        ),
        (["peft.method=lora", "peft.rank=0"], "peft.rank must be positive, got 0"),
        (["peft.method=prompt", "peft.prompt_tokens=128"], "peft.prompt_tokens (128) must be positive and leave room"),
        (["peft.method=ptuning", "peft.prompt_encoder=gru"], "peft.prompt_encoder must be one of mlp, lstm, got 'gru'"),
    ],
)
def test_bad_peft_settings_exit_2_with_one_line(overrides, message, tmp_path, capsys):
    args = ["train", "tiny", f"run.dir={tmp_path / 'run'}", "checkpoint.init_from=runs/base", *overrides]
    assert cli.main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err
    assert cli.main(["train", "tiny", f"run.dir={tmp_path / 'run'}", "peft.method=lora"]) == 2  # no base
    assert "peft.method=lora adapts a trained model: set checkpoint.init_from" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "change, message",
    [
        ("base", "holds adapters trained on another base model"),
        ("rank", "holds checkpoints of other adapters (peft.rank 4 (saved) vs 2)"),
    ],
)
def test_resuming_on_another_base_or_other_adapters_exits_2_touching_nothing(change, message, runs, tmp_path, capsys):
    root, configs, _, _ = runs
    shutil.copytree(root / "lora", tmp_path / "lora")
    before = sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "lora").rglob("*"))
    (tmp_path / "config.yaml").write_text(to_yaml(configs["lora"]))
    override = "peft.rank=2"
    if change == "base":  # the same architecture, one weight changed
        shutil.copytree(HF_BASE, tmp_path / "other")
        tensors = load_file(tmp_path / "other" / "model.safetensors")
        tensors["model.norm.weight"][0] += 1.0
        save_file(tensors, tmp_path / "other" / "model.safetensors", metadata={"format": "pt"})
        override = f"checkpoint.init_from=hf:{tmp_path / 'other'}"
    args = ["train", str(tmp_path / "config.yaml"), f"run.dir={tmp_path / 'lora'}", "mesh.fsdp=-1", override]
    assert cli.main(args) == 2  # on all 8 devices: a checkpoint restores onto any mesh
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err, err
    assert sorted((p.relative_to(tmp_path), p.stat().st_mtime_ns) for p in (tmp_path / "lora").rglob("*")) == before
