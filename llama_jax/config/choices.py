"""Every choice a user can type, in one place: dtypes, attention implementations, data choices, mesh
axes, logical axis names, remat tags, actions and policies, and the model fields a checkpoint must agree on.

checks.py checks values against these; the mechanisms that give them meaning live above it
(sharding.py maps the logical names onto mesh axes, remat.py turns policies into checkpoint policies).
"""

from __future__ import annotations

# float16 needs loss scaling, which the trainer does not do: bfloat16 has float32's range.
DTYPES = ("float32", "bfloat16")
FP8_RECIPES = ("none", "tensorwise")  # model.fp8
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn", "blocked")
PACKINGS = ("concat", "first_fit")
TEXT_UNITS = ("file", "paragraph", "line")
BAD_RECORD_ACTIONS = ("fail", "skip")
LR_SCHEDULES = ("cosine", "wsd")  # train.schedule (training/optimizer.py)
OPTIMIZERS = ("adamw", "muon")  # train.optimizer (training/optimizer.py)

# Parameter-efficient tuning (peft.*): the methods, the projections LoRA can adapt (a layer's q_proj ...
# down_proj) and P-tuning's prompt encoders.
PEFT_METHODS = ("none", "lora", "prompt", "ptuning")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PROMPT_ENCODERS = ("mlp", "lstm")

# Model fields that change the shape or type of a saved array: a checkpoint must agree on every one.
SHAPE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_dim",
    "tie_embeddings",
    "param_dtype",
)
# ... and those that change the function the same arrays compute. Resuming or initialising from a
# checkpoint that differs in one is refused unless checkpoint.allow_model_changes names it (e.g. a
# longer context with new RoPE scaling). Left out on purpose: compute_dtype, attention (the same
# function by another kernel), max_seq_len (positions beyond it are never used), init_std (unused once
# weights exist), cpu_projection, fp8 (the same function at another matmul precision).
FUNCTION_FIELDS = (
    "norm_eps",
    "rope_theta",
    "rope_scaling_factor",
    "rope_low_freq_factor",
    "rope_high_freq_factor",
    "rope_original_max_len",
)
ARCHITECTURE_FIELDS = SHAPE_FIELDS + FUNCTION_FIELDS

# Mesh axes, outermost (slowest links) to innermost (fastest); sharding.py builds the mesh.
MESH_AXES = ("pipeline", "data", "fsdp", "sequence", "tensor")
# mesh.pipeline_schedule (model/pipeline.py, model/one_f_one_b.py)
PIPELINE_SCHEDULES = ("gpipe", "1f1b")

# Logical axis names the model gives its parameters and activations; sharding.LOGICAL_AXIS_RULES maps
# each onto mesh axes, and `mesh.rules.<name>=<axes>` overrides one entry.
LOGICAL_AXES = (
    "layers",
    "vocab",
    "embed",
    "heads",
    "kv_heads",
    "head_dim",
    "mlp",
    "norm",  # parameters
    "lora_rank",
    "virtual_tokens",
    "prompt_hidden",  # adapters' parameters (peft.*)
    "batch",
    "seq",
    "residual_seq",
    "act_embed",
    "act_heads",
    "act_kv_heads",
    "act_mlp",
    "act_vocab",
)

# Every activation the model tags for recomputation policies (remat.py), in the order a layer computes them.
REMAT_TAGS = (
    "attn_norm",  # RMSNorm output before attention        [batch, seq, embed]
    "query_proj",  # q = x Wq                                [batch, seq, heads, head_dim]
    "key_proj",  # k = x Wk                                [batch, seq, kv_heads, head_dim]
    "value_proj",  # v = x Wv                                [batch, seq, kv_heads, head_dim]
    "attention_context",  # softmax(q kᵀ) v, the attention core     [batch, seq, heads, head_dim]
    "attention_out",  # context Wo                              [batch, seq, embed]
    "mlp_norm",  # RMSNorm output before the MLP           [batch, seq, embed]
    "mlp_gate",  # x Wgate                                 [batch, seq, mlp]
    "mlp_up",  # x Wup                                   [batch, seq, mlp]
    "mlp_hidden",  # silu(gate) * up                         [batch, seq, mlp]
    "mlp_out",  # hidden Wdown                            [batch, seq, embed]
)
# What a policy does with a tag: keep it in device memory, move it to pinned host memory, or recompute it.
REMAT_ACTIONS = ("save", "offload", "recompute")

_QKV = ("query_proj", "key_proj", "value_proj")
_PROJECTIONS = _QKV + ("attention_out", "mlp_gate", "mlp_up", "mlp_out")
_MATMUL_OUTPUTS = _PROJECTIONS + ("attention_context",)


def _all(tags: tuple[str, ...], action: str) -> dict[str, str]:
    return {tag: action for tag in tags}


# remat.policy names -> the tags they keep. None: no recomputation at all (the layer is not wrapped in
# remat). Tags left out are recomputed.
REMAT_POLICIES: dict[str, dict[str, str] | None] = {
    "none": None,
    # Keep only the layer input: recompute the whole layer, about one extra forward pass.
    "full": {},
    # Megatron's selective recomputation: keep every projection output and recompute the attention
    # core (q kᵀ, softmax, their product with v: what a fused kernel would keep), which is cheap
    # next to the projections, plus the elementwise norms and SwiGLU product.
    "selective": _all(_PROJECTIONS, "save"),
    # Keep every matmul output, the attention core's too; norms, rotary and SwiGLU are recomputed.
    "minimal": _all(_MATMUL_OUTPUTS, "save"),
    "save_qkv_proj": _all(_QKV, "save"),
    "save_dot_except_mlp": _all(_QKV + ("attention_context", "attention_out"), "save"),
    # Keep every matmul output and both norms' outputs (the projections' inputs): the backward pass recomputes
    # only rotary and the SwiGLU product. The `bench` preset's choice: on a CPU with memory to spare, no
    # matmul is run twice.
    "save_dot_and_norms": _all(_MATMUL_OUTPUTS + ("attn_norm", "mlp_norm"), "save"),
    # The same choices with the kept tensors in pinned host memory instead of HBM (GPU/TPU).
    "minimal_offload": _all(_MATMUL_OUTPUTS, "offload"),
    "qkv_proj_offload": _all(_QKV, "offload"),
}
