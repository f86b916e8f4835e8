"""What the hardware can do and what a compiled step costs: the numbers `plan`, `tune`, MFU and the memory
check read.

    hardware.py   peak FLOP/s, memory and link bandwidth per device (data sheets; measured on CPUs), budgets;
                  the published figures of the GPUs compiled for without them
    hlo.py        FLOPs (fp8 matmuls' apart), memory traffic and collective bytes per step from compiled HLO text
    op_cost.py    what one instruction of that text costs: its FLOPs (fp8 matmuls' apart) and the bytes it moves
    hlo_text.py   that text, read: computations, instructions, shapes and their bytes, collectives' device groups
    fmha.py       the FLOPs of cuDNN's fused attention calls in that text
    loops.py      how often a compiled while loop runs, as XLA:GPU's unrolling and pipelining leave it
    costmodel.py  tune's step-time model: a roofline over the compiled step plus exposed communication
    gpu_target.py XLA:GPU's compile for H100/H200/A100/B200 clusters on any machine (`--target`): the target
                  config, the topology, launch/gpu_env.sh's flags, cuDNN's workspace
    xla_flags.py  whether this jaxlib knows launch/gpu_env.sh's XLA flags (every command checks first)
    profiler.py   run.profile_steps: a jax.profiler trace of chosen training steps into run.dir/profile
    profile.py    `llama-jax profile`: where a traced step's time went (matmuls by type, attention, collectives,
                  fusions, copies, idle) and its longest ops
    op_class.py   what each op of a traced step is (a matmul by type, attention, a collective, ...), from its HLO

Imports distributed/ (which mesh axes cross hosts), model/ (the platform traced for), config/, files.py and
errors.py.
"""
