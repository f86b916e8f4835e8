"""Many devices and many processes: the device mesh and THE table mapping logical axis names onto it, joining a
multi-process run, and the agreements its processes make outside the jitted step.

    sharding.py   the mesh (pipeline, data, fsdp, sequence, tensor) and LOGICAL_AXIS_RULES; placing batches
    processes.py  joining a run through jax.distributed: config, environment, Slurm / Open MPI
    peers.py      named barriers, broadcasts and reductions with bounded waits (Peers)

Imports config/, model/ (parameter shapes, the sequence chunk order) and errors.py.
"""
