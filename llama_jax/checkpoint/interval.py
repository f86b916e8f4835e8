"""How often to save: Young and Daly's optimum, sqrt(2 x save cost x MTBF), for a step time and a save cost."""

from __future__ import annotations

import math

DEFAULT_MTBF_S = 3 * 3600.0  # Llama 3 405B: one interruption every ~3 h on 16k GPUs (a big-run figure)

def young_daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum of the checkpoint interval: sqrt(2 × save cost × MTBF)."""
    if save_s < 0 or mtbf_s <= 0:
        raise ValueError(f"need save_s >= 0 and mtbf_s > 0, got {save_s} and {mtbf_s}")
    return math.sqrt(2 * save_s * mtbf_s)

def auto_checkpoint_steps(save_s: float, mtbf_s: float, step_s: float) -> int:
    if step_s <= 0:
        raise ValueError(f"step_s must be positive, got {step_s}")
    return max(1, round(young_daly_interval_s(save_s, mtbf_s) / step_s))

def interval_advice(save_s: float, mtbf_s: float, step_s: float, every_steps: int, auto: bool = False,
                    key: str = "checkpoint.every_steps") -> str:
    """The log line: the Young/Daly interval for the measured save time next to the one in use."""
    derivation = f"sqrt(2 x save {save_s:.2f}s x MTBF {mtbf_s / 3600:.2g} h) = {young_daly_interval_s(save_s, mtbf_s):.0f}s"
    steps = auto_checkpoint_steps(save_s, mtbf_s, step_s)
    if auto:
        return f"{key}=auto: {derivation} at {step_s:.3f}s a step -> saving every {steps} steps"
    return (f"checkpoint interval advice (Young/Daly): {derivation} = {steps} steps; "
            f"{key} is {every_steps or 'only at the end'}")
