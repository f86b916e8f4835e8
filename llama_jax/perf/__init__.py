"""What the hardware can do and what a compiled step costs: the numbers `plan`, `tune`, MFU and the memory
check read.

    hardware.py   peak FLOP/s, memory and link bandwidth per device (data sheets; measured on CPUs), budgets
    hlo.py        FLOPs, memory traffic and collective bytes per step from compiled HLO text
    costmodel.py  tune's step-time model: a roofline over the compiled step plus exposed communication

Imports distributed/ (which mesh axes cross hosts), config/, files.py and errors.py.
"""
