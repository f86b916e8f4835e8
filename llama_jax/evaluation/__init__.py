"""Downstream evaluation: llama-jax models as an lm-evaluation-harness backend, and the task scores a run logs.

    scoring.py   log-likelihoods of continuations, batched by length, on one device or a mesh (no lm-eval)
    harness.py   the `llama-jax` lm-eval backend (an lm_eval.api.model.LM) on a model spec or live params
    tasks.py     tasks by name or YAML file, offline; running them; their scores as a run logs them

harness.py and tasks.py need the [eval] extra (lm-eval); nothing else in the package imports them at its top.
"""
