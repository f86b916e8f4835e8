"""A program's batches: their fields, shapes and shardings (what the train step is compiled for), the rows of each
global batch this process loads, a host batch placed on the mesh, and evaluation over a stream of them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from llama_jax.data.loader import Batches
from llama_jax.distributed import sharding

# The fields of a batch, each [batch, seq]: what the loader yields and the train step takes.
BATCH_FIELDS = {
    "tokens": jnp.int32,
    "targets": jnp.int32,
    "segment_ids": jnp.int32,
    "positions": jnp.int32,
    "loss_mask": jnp.float32,
}


def abstract_batch(program) -> dict[str, jax.ShapeDtypeStruct]:
    """Shapes, dtypes and sharding of one global batch of a TrainProgram: with its abstract_state(), what its train
    step is compiled for ahead of time (`llama-jax plan`)."""
    shape = (program.config.train.batch_size, program.config.train.seq_len)
    placed = sharding.batch_sharding(program.mesh)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=placed) for k, dtype in BATCH_FIELDS.items()}


def local_rows(program) -> list[int]:
    """The rows of every global batch of a TrainProgram that this process loads."""
    return sharding.process_rows(program.mesh, program.config.train.batch_size, program.config.train.seq_len)


def put_batch(program, batch: dict) -> dict[str, jax.Array]:
    """This process's rows of a batch (local_rows) as the global batch a TrainProgram's steps take."""
    return sharding.put_batch(batch, program.mesh, program.config.train.batch_size, program.config.mesh.load_balance)


def evaluate(program, params, batches: Batches, n_batches: int) -> float:
    """Mean next-token loss of the model params `params` (a state's model_params) over the first n_batches of
    `batches`, by a TrainProgram's eval step (inside its activate())."""
    total, count, rows = 0.0, 0.0, local_rows(program)
    for i in range(n_batches):
        loss_sum, n = program.eval_step(params, put_batch(program, batches.batch(i, rows)))
        total, count = total + float(loss_sum), count + float(n)
    return total / max(count, 1.0)
