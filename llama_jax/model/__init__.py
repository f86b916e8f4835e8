"""Llama 3 and what its forward pass runs. The model knows only logical axis names (distributed/ maps them
onto a mesh) and the mesh axes of its own shard_maps.

    llama.py             the model in Flax NNX, top to bottom: embedding, the layer stack, final norm, output
                         projection; LoRA in the projections, a learned prompt; the graph and params programs use
    params.py            how modules make their parameters: nnx.Params carrying logical axis names; stacked layers
    prompt_encoder.py    P-tuning's prompt encoder (an MLP, or a bidirectional LSTM and the MLP)
    dropout.py           LoRA's dropout keys, per step, layer and projection
    stack/               the ways of running the layer stack (scan, grouped remat, GPipe, 1F1B) behind one
                         interface, run_stack, each applying one Block to the same LayerInputs (apply_block)
    embedding.py         the embedding lookup; vocab-parallel where the table is split over its vocabulary alone
    rope.py              rotary positions: Llama 3's rescaled frequencies, the angles, the rotation
    flops.py             what a token costs: matmul parameters, training FLOPs (PaLM's count)
    attention.py         which attention kernel runs, document masks, the shard_maps of context parallelism
                         and of more tensor shards than kv heads
    flash.py             blocked (flash) causal attention in plain JAX with its own backward pass
    cudnn.py             cuDNN flash attention for packed documents, and its exact fallback
    context_parallel.py  per chunk of queries: its own block and the visible prefix of earlier chunks
    loss.py              the next-token loss fused with the output projection, over chunks of tokens
    projection.py        the projections' matmul, with a faster backward pass on CPU; as scaled fp8 matmuls
    norm.py              RMSNorm's function, with a backward pass that keeps only its input
    remat.py             recomputation policies -> jax.checkpoint policies
    stages.py            which layers each pipeline stage holds (even or uneven); the layers' storage order, relayout
    pipeline.py          pipeline layouts, and what both schedules share: stage rules, micro-batch splits, groups
    residuals.py         which of a VJP's residuals depend on the data, read from its jaxpr (kept per micro-batch)
    peft.py              adapters apart from the frozen base, the base's digest, LoRA folded into weights
    context.py           TraceContext: what a trace is for (platform, mesh, logical-axis rules), passed in, not ambient;
                         the logical-axis rules applied (logical_to_mesh_axes, with_logical_constraint)
    jax_workarounds.py   the jax limitations worked around, with the jax versions each applies to

Imports config/ and errors.py only.
"""
