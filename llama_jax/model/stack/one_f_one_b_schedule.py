"""The 1F1B schedule as a plan of iterations (mesh.pipeline_schedule=1f1b): tables computed before tracing, in
numpy, that say per iteration and stage what the loop of one_f_one_b.py runs; and what they imply, which the
planner reads without compiling (the loop's iterations, its bubble, how often each pass runs). No JAX here.

`schedule`'s tables say, per iteration and stage, which micro-batch and repeat run forward and backward and in
which slots, and which embeddings (and gradients) are handed on; a stage with nothing to do skips the work
(lax.cond). With V = P·R virtual stages, stage p runs the forward pass of item k = t - p and
the backward pass of item t - (V - 1) - (P - 1 - p), the items ordered as Megatron's interleaved schedule
orders them (P micro-batches through every repeat, then the next P): a micro-batch's activations reach the
next virtual stage exactly one iteration later, its gradient the previous one. The loop runs
M·R + V + P - 2 iterations: V - 1 of forward passes only, V - 1 of backward passes only, the rest both, which
costs the same bubble as GPipe's, (P - 1) / (M·R + P - 1). Stage p keeps about 2(P - p) - 1 micro-batches
(R = 1) in flight; with repeats a group is 1/R of the stage and stage 0 keeps about P + (P - 1)/R stages'
worth. The buffers are sized for the busiest stage (stage 0).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

VALID, MICROBATCH, REPEAT, SLOT = range(4)  # the columns of the tables
SLOTS_SCOPE = "pipeline_residual_slots"  # the name of the residual buffers in the compiled program (plan.py)
# The names of the conditionals of a forward pass, a loss and a backward pass in the compiled program (one_f_one_b.py
# names them; branch_runs says how often each runs).
FORWARD_SCOPE, LOSS_SCOPE, BACKWARD_SCOPE = "pipeline_forward", "pipeline_loss", "pipeline_backward"


@dataclass(frozen=True)
class Schedule:
    forward: np.ndarray  # [iterations, stages, 4]: valid, micro-batch, repeat, slot of each stage's forward pass
    backward: np.ndarray  # the same for the backward passes (all zero for a forward-only schedule)
    feed: np.ndarray  # [iterations, stages, 3]: valid, index, own: the embeddings a stage hands towards stage 0
    drain: np.ndarray  # the same for the embeddings' gradients, handed away from stage 0 to their owners
    slots: int  # residual slots per stage: the most micro-batch groups any stage keeps at once
    in_flight: tuple[int, ...]  # per stage, the most micro-batch groups it keeps at once

    @property
    def iterations(self) -> int:
        return self.forward.shape[0]


def iterations(stages: int, repeats: int, microbatches: int) -> int:
    """Of the 1F1B loop: M·R + V + P - 2 with V = P·R virtual stages."""
    return microbatches * repeats + stages * repeats + stages - 2


def compiled_bubble(stages: int, repeats: int, microbatches: int, loop_iterations: int) -> float:
    """The bubble of a compiled 1F1B loop of `loop_iterations`: V - 1 of them run forward passes only (1 unit of
    work), V - 1 backward passes only (2 units), the rest both (3): 1 - 3·M·R / (3·(iterations - V + 1))."""
    return 1 - microbatches * repeats / (loop_iterations - stages * repeats + 1)


@functools.cache
def schedule(stages: int, repeats: int, microbatches: int, backward: bool = True) -> Schedule:
    """The tables of the loop (see the module docstring), checked: every forward pass finds its input handed on
    in the iteration before, every backward pass its gradient, and no slot is overwritten while kept."""
    P, R, M = stages, repeats, microbatches
    V = P * R
    n = iterations(P, R, M) if backward else M * R + P - 1
    forward, backward_ = np.zeros((n, P, 4), np.int32), np.zeros((n, P, 4), np.int32)
    when_f, when_b = {}, {}
    for p in range(P):
        for k in range(M * R):
            group, rest = divmod(k, V)
            r, j = divmod(rest, P)
            m = group * P + j
            forward[k + p, p, :3] = (1, m, r)
            when_f[m, r, p] = k + p
            if backward:
                t = k + (V - 1) + (P - 1 - p)
                backward_[t, p, :3] = (1, m, R - 1 - r)
                when_b[m, R - 1 - r, p] = t
    for (m, r, p), t in when_f.items():
        before = (m, r, p - 1) if p else (m, r - 1, P - 1)
        assert before not in when_f or when_f[before] == t - 1 and (p or r), "forward pass before its input"
    for (m, r, p), t in when_b.items():
        after = (m, r, p + 1) if p < P - 1 else (m, r + 1, 0)
        assert (when_b[after] == t - 1) if after in when_b else (when_f[m, r, p] == t), "backward before its input"
    # Micro-batch m's embeddings (and later their gradient) are kept by stage m mod P, as the m // P-th of its
    # M/P: they travel one stage per iteration to stage 0, arriving as it needs them (its forward pass of m's
    # first repeat); the gradient travels back from stage 0 to its owner, the last ones in P - 1 iterations
    # after the loop.
    feed, drain = np.zeros((n, P, 3), np.int32), np.zeros((n + P - 1, P, 3), np.int32)
    needed = {t: forward[t, 0, MICROBATCH] for t in range(n) if forward[t, 0, VALID] and forward[t, 0, REPEAT] == 0}
    done = {t: backward_[t, 0, MICROBATCH] for t in range(n) if backward_[t, 0, VALID] and backward_[t, 0, REPEAT] == 0}
    for table, when in ((feed, lambda t, p: needed.get(t + p)), (drain, lambda t, p: done.get(t - p))):
        for t, p in np.ndindex(table.shape[:2]):
            if (m := when(t, p)) is not None:
                table[t, p] = (1, m // P, m % P == p)
    assert all(t >= m % P for t, m in needed.items()), "an owner hands on its embeddings before the step starts"
    in_flight = []
    for p in range(P):  # slots: a forward pass takes the lowest free one, its backward pass frees it
        kept, most = {}, 0
        for t in range(n):
            if forward[t, p, VALID]:
                free = min(set(range(len(kept) + 1)) - set(kept.values()))
                kept[tuple(forward[t, p, 1:3])] = forward[t, p, SLOT] = free
                most = max(most, len(kept))
            if backward_[t, p, VALID]:
                backward_[t, p, SLOT] = kept.pop(tuple(backward_[t, p, 1:3]))
        in_flight.append(most)
    return Schedule(forward, backward_, feed, drain, max(in_flight), tuple(in_flight))


def branch_runs(tables: Schedule, busiest: bool = False) -> dict[str, float]:
    """The share of iterations in which a stage runs a forward pass, a loss and a backward pass (hlo.analyze's
    `branch_runs`; otherwise it skips the work): on average over the stages (the work done), or, with
    `busiest`, on the busiest stage of each iteration (the time taken: every stage waits for it)."""
    last = tables.forward[..., REPEAT] == tables.forward[..., REPEAT].max()
    last_stage = np.arange(tables.forward.shape[1]) == tables.forward.shape[1] - 1
    runs = {
        FORWARD_SCOPE: tables.forward[..., VALID],
        BACKWARD_SCOPE: tables.backward[..., VALID],
        LOSS_SCOPE: tables.forward[..., VALID] * last * last_stage,
    }
    return {scope: float(ran.any(axis=1).mean() if busiest else ran.mean()) for scope, ran in runs.items()}
