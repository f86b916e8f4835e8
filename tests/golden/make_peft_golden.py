"""Make the PEFT goldens: adapters written by llama-jax's PEFT exporter (peft_format.py), loaded by Hugging
Face PEFT onto transformers' LlamaForCausalLM, and the logits PEFT computes with them, on the CPU.

    python -m venv /tmp/peft && /tmp/peft/bin/pip install torch==2.13.0 && \\
        /tmp/peft/bin/pip install transformers peft -e .
    /tmp/peft/bin/python tests/golden/make_peft_golden.py tests/golden/peft

The base is the HF golden tests/golden/hf/gqa_llama3_untied (GQA, llama3 rope scaling, untied). Each
adapter directory holds adapter_config.json, adapter_model.safetensors (as llama-jax writes them) and
golden.npz (tokens, logits from PEFT). tests/test_peft.py checks that llama-jax still writes the same files,
that its logits match PEFT's, and repeats the comparison live when torch and peft are installed.
"""

import json
import sys
from pathlib import Path

import numpy as np

BASE = Path(__file__).parent / "hf" / "gqa_llama3_untied"
# name -> peft.* settings of the adapters. LoRA on every projection kind, with rotary (q, k) and
# per-head (o) layouts; a learned prompt.
ADAPTERS = {
    "lora_all_targets": dict(method="lora", rank=4, alpha=8.0, targets=["q", "k", "v", "o", "gate", "up", "down"]),
    "prompt_tuning": dict(method="prompt", prompt_tokens=3),
}
SEED = 4321


def adapters(name: str) -> tuple[object, object, dict]:
    """(model config, peft settings, adapters in our layout): random values from SEED, B not zero."""
    import flax.linen as nn
    import jax

    from llama_jax.config import PeftConfig
    from llama_jax.interop import hf
    from llama_jax.model import peft
    from llama_jax.model.llama import abstract_params

    cfg, settings = hf.read_config(BASE), PeftConfig(**ADAPTERS[name])
    shapes = peft.split(nn.meta.unbox(abstract_params(cfg, settings)))[0]
    rng = np.random.default_rng(SEED)
    leaves, tree = jax.tree.flatten(shapes)
    values = [(0.05 * rng.standard_normal(s.shape)).astype(np.float32) for s in leaves]
    return cfg, settings, jax.tree.unflatten(tree, values)


def write(name: str, directory: Path) -> None:
    """The adapters of `name`, as llama-jax's exporter writes them."""
    from llama_jax.interop import peft_format

    cfg, settings, values = adapters(name)
    peft_format.write_adapter(directory, values, cfg, settings, BASE.name)


def tokens() -> np.ndarray:
    return np.load(BASE / "golden.npz")["tokens"][:, :12]


def peft_logits(directory: Path) -> np.ndarray:
    """What PEFT computes with the adapter directory on the base: [batch, (virtual tokens +) seq, vocab]."""
    import torch
    from peft import PeftModel
    from transformers import LlamaForCausalLM

    base = LlamaForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32).eval()
    model = PeftModel.from_pretrained(base, directory).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens())).logits.float().numpy()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "peft")
    for name in ADAPTERS:
        directory = out / name
        for old in directory.glob("*"):
            old.unlink()
        write(name, directory)
        np.savez(directory / "golden.npz", tokens=tokens(), logits=peft_logits(directory))
        import peft
        import torch
        import transformers
        (directory / "versions.json").write_text(json.dumps({"torch": torch.__version__, "peft": peft.__version__,
                                                             "transformers": transformers.__version__}) + "\n")
        print(f"{name} -> {directory}")


if __name__ == "__main__":
    main()
