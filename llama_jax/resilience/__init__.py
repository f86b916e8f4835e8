"""Keeping a long run alive and honest: everything that watches a run, accounts for its time, checks its
hardware or restarts it.

    watchdog.py      a step, save or restore without progress ends the process with a report (exit 124)
    flight.py        the flight recorder: each process's recent events, heartbeats, and the hang report naming
                     the process the others wait for
    preemption.py    SIGTERM/SIGINT -> save the current step and stop (exit 75)
    guards.py        non-finite steps and loss spikes; when to roll back
    stragglers.py    slow steps, and the host a multi-process fleet waits for
    goodput.py       effective training time across restarts, and the step clock
    preflight.py     the pre-flight health check of every device (`llama-jax doctor`, exit 71)
    fleet_rounds.py  its suspects measured again in rounds the whole fleet runs at once: slow, or loaded
    supervise.py     `llama-jax supervise`: restart a failed command with backoff
    inject.py        TESTING ONLY: the Injector, faults injected on purpose (the config's inject section) at named
                     points of the loop, the checkpointer, the barriers and the pre-flight check

Imports distributed/ (agreements between processes), config/, files.py and errors.py.
"""
