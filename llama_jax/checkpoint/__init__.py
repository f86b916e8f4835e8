"""A run's state on disk: the durable tier (Orbax, shared storage), the node-local tier (each host's own
storage, with partner copies), the models a user names (a run, a step, a Hugging Face directory), conversion
between formats, and the one place that decides where a run starts.

    durable.py       Orbax step directories: listing, meta, the model check, reading onto any mesh
    local.py         the node-local tier: each process's shards on its host, a partner's copy by a collective
    local_files.py   the local tier's files: each host's and process's directories, a step's files and manifest,
                     their CRC-32s, reading them back checked
    relayout.py      a local step on another process count or mesh, from the shards the hosts hold
    interval.py      Young/Daly: how often to save
    checkpointer.py  a run's Checkpointer: when a save is due, saving and restoring across tiers
    failed_saves.py  a run's failed durable saves: the step removed, a warning, or the run stopped (exit 74)
    storage_failures.py  a write's storage failures: which errors are the storage's, their one-line record, the
                     room check before a save, Orbax's log records of them
    specs.py         model specs: hf:DIR, a run, a step -> architecture, params, tokenizer
    convert.py       `llama-jax convert`: Hugging Face <-> llama-jax, PEFT adapters
    average.py       `llama-jax average`: the mean of a run's checkpoints, a parameter at a time
    start.py         where a run starts, decided in one place: its own steps, resume_from, init_from, a base

Imports resilience/ (goodput's observed failures), interop/, distributed/, model/, data/ (tokenizers),
config/, files.py and errors.py.
"""
