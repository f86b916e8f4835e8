"""Make the Hugging Face parity goldens: tiny random LlamaForCausalLM models, their logits and greedy
generations, computed by transformers' PyTorch implementation on the CPU.

    python -m venv /tmp/hf && /tmp/hf/bin/pip install torch==2.13.0 transformers safetensors numpy
    /tmp/hf/bin/python tests/golden/make_hf_golden.py tests/golden/hf

tests/test_hf.py compares llama-jax with these files (and with transformers itself when it is installed).
Each model directory holds config.json, the safetensors weights and golden.npz (tokens, logits,
prompt, generated).
"""

import json
import shutil
import sys
from pathlib import Path

import numpy as np

# name -> LlamaConfig fields. Small enough to commit, varied enough to catch conversion bugs:
# GQA, llama3 rope scaling, tied and untied output, explicit head_dim, a vocab not a multiple of 64.
MODELS = {
    "gqa_llama3_untied": dict(
        vocab_size=300,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=128,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "tied_head_dim": dict(
        vocab_size=203,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=48,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=True,
    ),
    "mha_sharded_files": dict(
        vocab_size=192,
        hidden_size=32,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=2,
        intermediate_size=40,
        max_position_embeddings=128,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    ),
}
SEED = 1234


def make(out: Path, name: str, fields: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    config = LlamaConfig(
        rms_norm_eps=1e-5, hidden_act="silu", bos_token_id=None, eos_token_id=None, pad_token_id=None, **fields
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # random norm scales too, so a swapped norm cannot go unnoticed
        for layer in model.model.layers:
            layer.input_layernorm.weight.uniform_(0.5, 1.5)
            layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
        model.model.norm.weight.uniform_(0.5, 1.5)
    directory = out / name
    shutil.rmtree(directory, ignore_errors=True)
    shard = "20KB" if name == "mha_sharded_files" else "100MB"
    model.save_pretrained(directory, safe_serialization=True, max_shard_size=shard)
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, fields["vocab_size"], size=(2, 24))
    prompt = rng.integers(0, fields["vocab_size"], size=(1, 5))
    with torch.no_grad():
        logits = model(torch.tensor(tokens)).logits.float().numpy()
        generated = model.generate(
            torch.tensor(prompt), max_new_tokens=12, do_sample=False, num_beams=1, eos_token_id=None, pad_token_id=0
        )[0, prompt.shape[1] :].numpy()
    np.savez(directory / "golden.npz", tokens=tokens, logits=logits, prompt=prompt[0], generated=generated)
    import transformers

    (directory / "versions.json").write_text(
        json.dumps({"torch": torch.__version__, "transformers": transformers.__version__}) + "\n"
    )
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters -> {directory}")


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).parent / "hf")
    out.mkdir(parents=True, exist_ok=True)
    for name, fields in MODELS.items():
        make(out, name, fields)


if __name__ == "__main__":
    main()
