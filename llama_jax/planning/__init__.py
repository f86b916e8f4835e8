"""What a run will cost before it runs, and the layout that costs least: built on perf/'s analysis of compiled
steps and on training/'s programs, above both.

    plan.py                `llama-jax plan`: memory, FLOPs and collectives of the compiled step (also for GPUs
                           that are not here: `--target`)
    plan_report.py         what plan found: the plan as text or JSON, a staged run's plans, the remat policies
                           side by side, what a hang report says of the running program
    tune.py                `llama-jax tune`: search meshes, micro-batches and remat with the cost model
    tune_space.py          tune's candidates: every mesh, micro-batching and remat searched, valid or why not
    tune_report.py         what tune found: the ranked table, JSON, the winner's config as YAML
    goodput_projection.py  `llama-jax goodput`: a run's inputs (given, measured, stated)
    goodput_report.py      what the projection found: goodput, the best intervals, sensitivity, the inputs; text, JSON
    goodput_model.py       the projection's model: goodput under failures and the best checkpoint intervals

Imports training/ and everything below it.
"""
