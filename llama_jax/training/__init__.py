"""Training: the compiled step, the optimizer, the loop and what it reports, and the commands that plan a run
before it starts.

    step.py        the train state; TrainProgram: the compiled init, train and eval steps of one config on one mesh
    timing.py      timing train steps on random tokens (tune's measurements, bench/step.py, gpu-check)
    optimizer.py   AdamW, the lr schedule (warmup, cosine or WSD, decay phase), clipping, the weight-decay mask
    run.py         a run before its first step: everything the loop needs, built and checked before anything in
                   run.dir is written
    loop.py        train(config): join, mesh, data, input checks; the training loop's order of events
    loop_parts.py  the Loop: the parts that watch, account and decide around one run, step by step
    metrics.py     the progress line, metrics.jsonl, TensorBoard, W&B, the throughput meter and MFU
    report.py      report.png
    plan.py        `llama-jax plan`: memory, FLOPs and collectives of the compiled step
    tune.py        `llama-jax tune`: search meshes, micro-batches and remat with the cost model
    tune_space.py  tune's candidates: every mesh, micro-batching and remat searched, valid or why not
    tune_report.py what tune found: the ranked table, JSON, the winner's config as YAML
    goodput_projection.py  `llama-jax goodput`: a run's inputs (given, measured, stated) and the report
    goodput_model.py       the projection's model: goodput under failures and the best checkpoint intervals

Imports every subpackage below it.
"""
