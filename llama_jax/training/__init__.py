"""Training: the compiled step, the optimizer, the loop and what it reports.

    step.py        the train state; TrainProgram: the compiled init, train and eval steps of one config on one mesh
    timing.py      timing train steps on random tokens (tune's measurements, bench/step.py, gpu-check)
    optimizer.py   AdamW, the lr schedule (warmup, cosine or WSD, decay phase), clipping, the weight-decay mask
    run.py         a run before its first step: everything the loop needs, built and checked before anything in
                   run.dir is written; the process-wide settings a run makes at its start
    loop.py        train(config): join, mesh, data, input checks; the training loop's order of events
    loop_parts.py  the Loop: the parts that watch, account and decide around one run, step by step
    metrics.py     the progress line, metrics.jsonl, TensorBoard, W&B, the throughput meter and MFU
    report.py      report.png

The commands that plan a run before it starts (plan, tune, goodput) are planning/'s, above this one.
Imports every subpackage below it.
"""
