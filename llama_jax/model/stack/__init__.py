"""The layer stack: the ways of running the model's layers, behind one interface, each applying one Block.

    layer.py        LayerInputs (what every layer reads besides x, one typed pytree), Stack (how the layers run,
                    from the config), apply_block (one layer on its params), Head (the loss, for 1F1B)
    run.py          run_stack(stack, params, x, segment_ids, positions, head, dropout_key, cache): the one entry
    scan.py         the plain way: one layer body under jax.lax.scan over the stacked params; decoding's cache
    grouped.py      grouped remat (one layer in every_n recomputes), and a pipeline stage's group of layers
    gpipe.py        the GPipe schedule: every micro-batch's forward pass, then autodiff back through the loop
    one_f_one_b.py  the 1F1B schedule: per iteration one forward and one backward pass per stage, explicit VJPs
    one_f_one_b_schedule.py
                    its tables, computed before tracing: per iteration and stage, which micro-batch and repeat
                    run forward and backward, in which slot; the loop's iterations and bubble

The model (llama.py) says embed -> run_stack -> final norm -> head; the pipelines' layouts and micro-batch
splits are pipeline.py's, the layers' storage order stages.py's.
"""

from llama_jax.model.stack.layer import Head, LayerInputs, Stack, apply_block
from llama_jax.model.stack.run import run_stack

__all__ = ["Head", "LayerInputs", "Stack", "apply_block", "run_stack"]
