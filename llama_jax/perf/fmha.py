"""cuDNN fused attention (`__cudnn$fmha*`) in compiled HLO: its FLOPs (hlo.py counts the program's).

By its matmuls over P visible (query, key) pairs, B x H query heads (GQA's fewer K/V heads change nothing)
and head dim D: forward S = Q·Kᵀ and O = P·V, 4·B·H·P·D; backward 10·B·H·P·D, since cuDNN's flash backward
keeps only softmax statistics and recomputes S besides computing dV, dP, dQ, dK. P = Tq·Tk, or for a causal
mask (CAUSAL, PADDING_CAUSAL; diagonal top-left) the pairs on and below the diagonal, T(T+1)/2 when
Tq = Tk = T, and with a sliding window w only each query's w latest keys. Padding and packed documents
are runtime data, so P is for full rows: an upper bound. Per layer and token, step.model_flops_per_token
(model.train_flops_per_token) counts attention 12·H·D·T, halved for a causal-skipping kernel such as
cuDNN, without recomputation; the HLO count for cuDNN is 7·H·D·(T+1), 7/6 x (T+1)/T of that.
"""

from __future__ import annotations

import math


def dimensions(numbers: dict, name: str) -> list[int]:
    """One list of an XLA dot dimension numbers proto, as JSON."""
    return [int(d) for d in numbers.get(name, [])]  # int64 as strings, empty lists omitted


def attention_flops(config: dict, q: list[int], k: list[int], v: list[int], backward: bool) -> float:
    """A cuDNN fused attention call's FLOPs (module docstring), from its cudnn_fmha_backend_config and the dims of
    its first operands, Q, K and V, in any layout: which of their dims are batch x heads and which the sequence
    comes from the dot dimension numbers."""
    if backward:  # dK = dPᵀ·Q and dQ = dP·K: Q and K are the rhs, contracted over the sequence
        (heads, tq), (kv_heads, tk) = (
            _heads_and_length(q, config["bmm1_grad_gemm1_dot_dimension_numbers"], "rhs", sequence_contracted=True),
            _heads_and_length(k, config["bmm1_grad_gemm2_dot_dimension_numbers"], "rhs", sequence_contracted=True),
        )
    else:  # S = Q·Kᵀ contracts the head dims; the rest of each is its sequence
        bmm1 = config["bmm1_dot_dimension_numbers"]
        (heads, tq), (kv_heads, tk) = (
            _heads_and_length(q, bmm1, "lhs", sequence_contracted=False),
            _heads_and_length(k, bmm1, "rhs", sequence_contracted=False),
        )
    d_qk, d_v = math.prod(q) // (heads * tq), math.prod(v) // (kv_heads * tk)  # V shares K's batch and sequence
    window = int(config.get("sliding_window_length", 0))  # cuDNN's window is left of a causal diagonal
    causal = config.get("mask_type", "NO_MASK") in ("CAUSAL", "PADDING_CAUSAL") or window > 0
    pairs = _visible_pairs(tq, tk, window) if causal else tq * tk
    if not backward:
        return 2.0 * heads * pairs * (d_qk + d_v)  # S = Q·Kᵀ, O = P·V
    recomputes_scores = config.get("is_flash_attention", True)  # flash keeps softmax statistics, not P
    return 2.0 * heads * pairs * (2 * d_qk + 2 * d_v + (d_qk if recomputes_scores else 0))  # dQ dK, dV dP, S


def _heads_and_length(dims: list[int], numbers: dict, side: str, sequence_contracted: bool) -> tuple[int, int]:
    """(batch x heads, sequence length) of one attention operand, from one of cuDNN's dot dimension numbers."""
    batch = dimensions(numbers, f"{side}_batch_dimensions")
    contracting = dimensions(numbers, f"{side}_contracting_dimensions")
    sequence = contracting if sequence_contracted else [i for i in range(len(dims)) if i not in batch + contracting]
    return math.prod(dims[i] for i in batch), math.prod(dims[i] for i in sequence)


def _visible_pairs(tq: int, tk: int, window: int) -> int:
    """(query, key) pairs a causal mask keeps: query i sees keys j <= i (cuDNN aligns the diagonal top-left)
    and, with a sliding window, only j > i - window. Queries from tk + window on see no key."""

    def triangle(n: int) -> int:
        return n * (n + 1) // 2

    window = window if window > 0 else tq + tk
    rows = min(tq, tk + window)
    return triangle(min(rows, tk)) + max(0, rows - tk) * tk - triangle(max(0, rows - window))
