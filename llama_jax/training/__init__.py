"""Training: the compiled step, the optimizer, the loop and what it reports.

    step.py        the train state, the loss and the train step's body
    program.py     TrainProgram: the compiled init, train and eval steps of one config on one mesh
    memory.py      what a step needs in device memory; the fewest micro-batches whose step fits
    batches.py     a batch's fields, its placement on the mesh, evaluation on the validation stream
    timing.py      timing train steps on random tokens (tune's measurements, bench/step.py, gpu-check)
    optimizer.py   AdamW, the lr schedule (warmup, cosine or WSD, decay phase), clipping, the weight-decay mask
    run.py         a run before its first step: everything the loop needs, built and checked before anything in
                   run.dir is written; the process-wide settings a run makes at its start
    loop.py        train(config): join, mesh, data, input checks; the loop: segments, and a segment's steps
    segments.py    the Loop: start, segments (a stage, or the stretch after a rollback), dispatch, read, finish
    parts.py       the parts of the loop and their one protocol: evaluation, saves, guard, goodput, metrics, ...
    metrics.py     the progress line, metrics.jsonl, TensorBoard, W&B, the throughput meter and MFU
    report.py      report.png

The commands that plan a run before it starts (plan, tune, goodput) are planning/'s, above this one.
Imports every subpackage below it.
"""
