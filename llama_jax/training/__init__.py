"""Training: the compiled step, the optimizer, the loop and what it reports, and the commands that plan a run
before it starts.

    step.py       the train state; TrainProgram: the compiled init, train and eval steps of one config on one mesh
    optimizer.py  AdamW, the lr schedule (warmup, cosine or WSD, decay phase), clipping, the weight-decay mask
    loop.py       train(config): join, mesh, data, input checks; the training loop
    metrics.py    the progress line, metrics.jsonl, TensorBoard, W&B, the throughput meter and MFU
    report.py     report.png
    plan.py       `llama-jax plan`: memory, FLOPs and collectives of the compiled step
    tune.py       `llama-jax tune`: search meshes, micro-batches and remat with the cost model
    goodput_projection.py  `llama-jax goodput`: expected effective training time under failures, best intervals

Imports every subpackage below it.
"""
