"""The peer: the same model and optimizer step in Hugging Face transformers + PyTorch, timed the way
bench/step.py times ours. Run by bench/step.py in the same invocation (or alone):

    .venv/bin/python bench/peer.py [--preset bench] [--steps 5] [--compile] [--profile N] [--json out.json] \\
        [key=value ...]

Needs torch and transformers (`pip install torch transformers`; on this CPU machine
`pip install torch==2.13.0` takes the local CPU build), not JAX nor an installed llama-jax: the model and
batch are the preset's with the key=value overrides, as this repository's llama_jax.config builds them
(bench/step.py passes its own). fp32, AdamW (β2 0.95, weight decay 0.1, as ours), gradient clipping 1.0,
random tokens, SDPA attention (transformers' default), all cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

# This repository's llama_jax, also for an interpreter without llama-jax installed (bench/step.py --peer-python):
# its config package imports no JAX and needs only PyYAML, which transformers requires.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from llama_jax.config import load_config  # noqa: E402


def model_dimensions(preset: str, overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """The dimensions of a preset (or YAML file) with key=value overrides, from the project's own loader: the
    presets live where it looks for them (llama_jax/config/presets), and the defaults and types are the schema's."""
    config = load_config(preset, list(overrides))
    model, train = config.model, config.train
    return {
        "vocab": model.vocab_size,
        "d_model": model.d_model,
        "layers": model.n_layers,
        "heads": model.n_heads,
        "kv_heads": model.n_kv_heads,
        "ffn": model.ffn_dim,
        "head_dim": model.resolved_head_dim,
        "tied": model.tie_embeddings,
        "rope_theta": model.rope_theta,
        "batch": train.batch_size,
        "seq": train.seq_len,
    }


def measure(dims: dict, steps: int, warmup: int, compiled: bool, profile: int = 0) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count() or 1)
    config = LlamaConfig(
        vocab_size=dims["vocab"],
        hidden_size=dims["d_model"],
        num_hidden_layers=dims["layers"],
        num_attention_heads=dims["heads"],
        num_key_value_heads=dims["kv_heads"],
        head_dim=dims["head_dim"],
        intermediate_size=dims["ffn"],
        max_position_embeddings=max(dims["seq"], 2048),
        rope_theta=dims["rope_theta"],
        tie_word_embeddings=dims["tied"],
        use_cache=False,
    )
    model = LlamaForCausalLM(config).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    tokens = torch.randint(0, dims["vocab"], (dims["batch"], dims["seq"] + 1))
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    def forward_backward():
        logits = model(input_ids=inputs).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))
        loss.backward()
        return loss

    if compiled:
        forward_backward = torch.compile(forward_backward)

    def step():
        optimizer.zero_grad(set_to_none=True)
        loss = forward_backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        return float(loss)

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    return {
        "step_s": seconds,
        "tokens_per_s": dims["batch"] * dims["seq"] / seconds,
        "torch": torch.__version__,
        "params": sum(p.numel() for p in model.parameters()),
    } | ({"profile": profile_steps(step, profile)} if profile else {})


# torch's CPU ops by what they compute: its matmuls (the linear layers' and the loss's), its attention kernel.
MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm")
ATTENTION_OPS = ("_scaled_dot_product", "_flash_attention")


def profile_steps(step, steps: int, top: int = 12) -> dict:
    """Where `steps` eager steps spend their time, per step, by torch.profiler: every op's own time (the time in
    it less its children's; on a CPU the ops run one after another on the calling thread, so they add up to the
    step), its matmuls and attention apart, and the `top` ops."""
    import torch

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            step()
        wall = (time.perf_counter() - start) / steps
    ops = {e.key: e.self_cpu_time_total / 1e6 / steps for e in prof.key_averages()}
    matmul = sum(v for k, v in ops.items() if k in MATMUL_OPS)
    attention = sum(v for k, v in ops.items() if any(a in k for a in ATTENTION_OPS))
    return {
        "step_s": wall,
        "ops_s": sum(ops.values()),
        "matmul_s": matmul,
        "attention_s": attention,
        "top": sorted(ops.items(), key=lambda kv: -kv[1])[:top],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="bench")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--compile", action="store_true", help="also measure torch.compile")
    parser.add_argument("--profile", type=int, default=0, metavar="N", help="then profile N eager steps (torch)")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="as for bench/step.py and llama-jax train")
    args = parser.parse_args()

    dims = model_dimensions(args.preset, args.overrides)  # first: a bad preset or key fails before torch is needed
    import transformers

    results = {
        "preset": args.preset,
        "overrides": args.overrides,
        "dims": dims,
        "transformers": transformers.__version__,
        "eager": measure(dims, args.steps, args.warmup, compiled=False, profile=args.profile),
    }
    if args.compile:
        try:
            results["compiled"] = measure(dims, args.steps, args.warmup, compiled=True)
        except Exception as err:  # torch.compile needs a C++ toolchain and may not support the CPU
            results["compiled"] = {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"}
    for mode in ("eager", "compiled"):
        if mode in results and "tokens_per_s" in results[mode]:
            r = results[mode]
            print(
                f"peer {mode}: transformers {results['transformers']} + torch {r['torch']}: "
                f"{r['tokens_per_s']:.1f} tokens/s ({r['step_s']:.3f} s/step)"
            )
        elif mode in results:
            print(f"peer {mode}: failed: {results[mode]['error']}")
    if profile := results["eager"].get("profile"):
        share = lambda s: f"{s * 1e3:.1f} ms ({s / profile['step_s']:.0%})"  # noqa: E731
        print(
            f"peer eager profile, per step: {profile['step_s'] * 1e3:.1f} ms; ops {share(profile['ops_s'])}, "
            f"matmuls {share(profile['matmul_s'])}, attention {share(profile['attention_s'])}"
        )
        for name, seconds in profile["top"]:
            print(f"  {share(seconds):>16}  {name}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
