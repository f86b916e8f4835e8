"""The sections of bench/gpu_check.py (`make gpu-check`), one module each: the table, attention parity, the train
step, its fp8 twin, the body (the marginal layer) and the environment."""
