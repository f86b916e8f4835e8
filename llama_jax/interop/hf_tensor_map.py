"""Which Hugging Face tensor each llama-jax parameter is made of, and how the two lay out the same numbers
(Tensor's layouts); no reading or writing (hf.py streams the tensors through these).

    Hugging Face (per layer i, torch [out, in])         llama-jax (layers stacked on axis 0)
    model.embed_tokens.weight            [V, D]         embed/embedding                [V, D]
    model.layers.i.self_attn.q_proj      [N*H, D]       layers/attn/q_proj/kernel      [L, D, N, H]
                             k_proj/v_proj [K*H, D]     layers/attn/{k,v}_proj/kernel  [L, D, K, H]
                             o_proj      [D, N*H]       layers/attn/o_proj/kernel      [L, N, H, D]
    model.layers.i.mlp.gate_proj/up_proj [F, D]         layers/mlp/{gate,up}_proj/kernel [L, D, F]
                       down_proj         [D, F]         layers/mlp/down_proj/kernel    [L, F, D]
    model.layers.i.input_layernorm       [D]            layers/attn_norm/scale         [L, D]
    model.layers.i.post_attention_layernorm [D]         layers/mlp_norm/scale          [L, D]
    model.norm.weight                    [D]            final_norm/scale               [D]
    lm_head.weight                       [V, D]         lm_head/kernel                 [D, V]  (absent when tied)

Rotary layout: our model and transformers rotate (x[i], x[i + H/2]) ("rotate_half"); Meta's original
checkpoints rotate interleaved pairs (x[2i], x[2i+1]). With rotary="interleaved" the q/k rows of each
head are reordered between the two (evens first, then odds), as transformers' own conversion does.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from llama_jax.config import ModelConfig

ROTARY_LAYOUTS = ("half", "interleaved")


@dataclass(frozen=True)
class Tensor:
    """One llama-jax parameter and the Hugging Face tensor(s) it is made of. `layout` says how one
    layer of ours (left) and the Hugging Face tensor (right) hold the same numbers:

        same        ours[...] == hf[...]                         embedding, norms
        transposed  ours[i, j] == hf[j, i]                       MLP, lm_head
        heads_in    ours[d, n, h] == hf[n * head_dim + h, d]     q, k, v projections
        heads_out   ours[n, h, d] == hf[d, n * head_dim + h]     o projection
    """

    path: tuple[str, ...]  # in our params tree
    hf_name: str  # with {i} for the layer index when per_layer
    per_layer: bool
    layout: str

    @property
    def row_axis(self) -> int:
        """The axis of ours (one layer) along which the Hugging Face tensor's rows run."""
        return {"same": 0, "transposed": 1, "heads_in": 1, "heads_out": 2}[self.layout]

    @property
    def rotary(self) -> bool:
        """Whether the rows are rotated by RoPE (q and k, and the B of their LoRA adapters), so their order
        depends on the rotary layout."""
        return self.hf_name.endswith(("q_proj.weight", "k_proj.weight", "q_proj.lora_B.weight", "k_proj.lora_B.weight"))

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The Hugging Face tensor's shape for one layer of ours of `shape`."""
        if self.layout == "same":
            return tuple(shape)
        if self.layout == "transposed":
            return tuple(shape[::-1])
        if self.layout == "heads_in":
            return shape[1] * shape[2], shape[0]
        return shape[2], shape[0] * shape[1]

    def to_hf(self, w: np.ndarray) -> np.ndarray:
        """A block of ours (one layer, any range along row_axis) -> those rows of the Hugging Face tensor."""
        if self.layout == "same":
            return w
        if self.layout == "transposed":
            return w.T
        if self.layout == "heads_in":
            return w.reshape(w.shape[0], -1).T
        return w.reshape(-1, w.shape[-1]).T

    def from_hf(
        self,
        read: Callable[[tuple[slice, ...]], np.ndarray],
        index: tuple[slice, ...],
        head_dim: int,
        interleaved: bool,
    ) -> np.ndarray:
        """ours[index] (one layer; slices with start and stop), reading only the Hugging Face rows and
        columns it needs with read(hf_index)."""
        if self.layout == "same":
            return read(index)
        if self.layout == "transposed":
            return read(index[::-1]).T
        if self.layout == "heads_in":
            d, n, h = index
            w = read((slice(n.start * head_dim, n.stop * head_dim), d))  # [n * head_dim, d]
            if interleaved and self.rotary:
                w = interleaved_to_half(w, n.stop - n.start)
            return w.reshape(n.stop - n.start, head_dim, -1)[:, h].transpose(2, 0, 1)
        n, h, d = index
        w = read((d, slice(n.start * head_dim, n.stop * head_dim)))  # [d, n * head_dim]
        return w.reshape(w.shape[0], n.stop - n.start, head_dim)[:, :, h].transpose(1, 2, 0)


def tensor_map(cfg: ModelConfig) -> list[Tensor]:
    layer = "model.layers.{i}."
    tensors = [
        Tensor(("embed", "embedding"), "model.embed_tokens.weight", False, "same"),
        Tensor(("layers", "attn", "q_proj", "kernel"), layer + "self_attn.q_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "k_proj", "kernel"), layer + "self_attn.k_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "v_proj", "kernel"), layer + "self_attn.v_proj.weight", True, "heads_in"),
        Tensor(("layers", "attn", "o_proj", "kernel"), layer + "self_attn.o_proj.weight", True, "heads_out"),
        Tensor(("layers", "mlp", "gate_proj", "kernel"), layer + "mlp.gate_proj.weight", True, "transposed"),
        Tensor(("layers", "mlp", "up_proj", "kernel"), layer + "mlp.up_proj.weight", True, "transposed"),
        Tensor(("layers", "mlp", "down_proj", "kernel"), layer + "mlp.down_proj.weight", True, "transposed"),
        Tensor(("layers", "attn_norm", "scale"), layer + "input_layernorm.weight", True, "same"),
        Tensor(("layers", "mlp_norm", "scale"), layer + "post_attention_layernorm.weight", True, "same"),
        Tensor(("final_norm", "scale"), "model.norm.weight", False, "same"),
    ]
    if not cfg.tie_embeddings:
        tensors.append(Tensor(("lm_head", "kernel"), "lm_head.weight", False, "transposed"))
    return tensors


def interleaved_to_half(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q/k rows of Meta's interleaved rotary layout -> rotate_half: per head, even rows then odd rows."""
    heads = w.reshape(n_heads, -1, w.shape[-1])
    return np.concatenate([heads[:, 0::2], heads[:, 1::2]], axis=1).reshape(w.shape)


def half_to_interleaved(w: np.ndarray, n_heads: int) -> np.ndarray:
    heads = w.reshape(n_heads, -1, w.shape[-1])
    half = heads.shape[1] // 2
    out = np.empty_like(heads)
    out[:, 0::2], out[:, 1::2] = heads[:, :half], heads[:, half:]
    return out.reshape(w.shape)
