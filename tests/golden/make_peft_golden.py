"""Make the PEFT goldens, on the CPU: adapters written by llama-jax's PEFT exporter (peft_format.py), loaded
by Hugging Face PEFT onto transformers' LlamaForCausalLM, and the logits PEFT computes with them; and
adapters made and saved by PEFT itself (get_peft_model + save_pretrained), which llama-jax reads.

    python -m venv /tmp/peft && /tmp/peft/bin/pip install torch==2.13.0 && \\
        /tmp/peft/bin/pip install transformers peft -e .
    /tmp/peft/bin/python tests/golden/make_peft_golden.py tests/golden/peft

The base is the HF golden tests/golden/hf/gqa_llama3_untied (GQA, llama3 rope scaling, untied). Each
adapter directory holds adapter_config.json, adapter_model.safetensors (as llama-jax writes them) and
golden.npz (tokens, logits from PEFT). tests/test_peft.py checks that llama-jax still writes the same files,
that its logits match PEFT's, and repeats the comparison live when torch and peft are installed. The
directories of PEFT_MADE hold what PEFT's save_pretrained wrote and golden.npz (tokens, logits from PEFT
with the adapter as saved, loaded back onto the fp32 base); tests/test_peft_read.py reads them.
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
# name -> PEFT LoraConfig fields and the dtype PEFT saves the adapter in: every projection in fp32; a few in bf16
# with rank-stabilised scaling (alpha / sqrt(r)).
PEFT_MADE = {
    "peft_made_lora": (
        dict(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        ),
        "float32",
    ),
    "peft_made_rslora_bf16": (
        dict(r=2, lora_alpha=3, use_rslora=True, target_modules=["q_proj", "v_proj", "down_proj"]),
        "bfloat16",
    ),
}


def adapters(name: str) -> tuple[object, object, dict]:
    """(model config, peft settings, adapters in our layout): random values from SEED, B not zero."""
    import jax

    from llama_jax.config import PeftConfig
    from llama_jax.interop import hf_config
    from llama_jax.model import peft
    from llama_jax.model.llama import param_shapes

    cfg, settings = hf_config.read_config(BASE), PeftConfig(**ADAPTERS[name])
    shapes = peft.split(param_shapes(cfg, settings))[0]
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


def make_with_peft(name: str, directory: Path) -> None:
    """An adapter made by PEFT: LoRA of PEFT_MADE[name] on the base, A and B drawn from N(0, 0.05^2) with
    torch's SEED (B not zero), saved by PeftModel.save_pretrained in the dtype named."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    fields, dtype = PEFT_MADE[name]
    torch.manual_seed(SEED)
    base = LlamaForCausalLM.from_pretrained(BASE, torch_dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(task_type="CAUSAL_LM", lora_dropout=0.0, **fields))
    with torch.no_grad():
        for parameter_name, parameter in model.named_parameters():
            if "lora_" in parameter_name:
                parameter.normal_(0.0, 0.05)
    model.to(getattr(torch, dtype))  # the adapters are the only trainable weights PEFT saves
    model.save_pretrained(directory)
    (directory / "README.md").unlink()  # PEFT's model card: nothing a test reads
    config = json.loads((directory / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = BASE.name  # not this machine's path: the tests name the base
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_versions(directory: Path) -> None:
    import peft
    import torch
    import transformers

    (directory / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "peft": peft.__version__, "transformers": transformers.__version__})
        + "\n"
    )


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "peft")
    makers = {
        **{name: (make_with_peft, " (made by PEFT)") for name in PEFT_MADE},
        **{name: (write, "") for name in ADAPTERS},
    }
    for name, (make, how) in makers.items():
        directory = out / name
        directory.mkdir(parents=True, exist_ok=True)
        for old in directory.glob("*"):
            old.unlink()
        make(name, directory)
        np.savez(directory / "golden.npz", tokens=tokens(), logits=peft_logits(directory))
        write_versions(directory)
        print(f"{name}{how} -> {directory}")


if __name__ == "__main__":
    main()
