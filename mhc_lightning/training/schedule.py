"""LitLM's learning-rate schedule: linear warmup, then a cosine decay to min_ratio x lr at the planned last step.

A callable object, not a closure, so that LambdaLR saves its numbers in every checkpoint and restores them on resume: a
resumed run keeps the schedule it was planned with. A new step budget is explicit (`mhc fit ... --ckpt_path last
--extend`, fit/resume.py) and `extend` applies the one policy: the cosine continues from the factor reached at the
resume step down to min_ratio at the new last step, so the learning rate never jumps (a run that had finished its decay
stays at the minimum).
"""

from __future__ import annotations

import math


class WarmupCosine:
    def __init__(self, warmup: int, total: int, min_ratio: float):
        self.warmup, self.total, self.min_ratio = int(warmup), int(total), float(min_ratio)
        self.decay_start, self.decay_from = self.warmup, 1.0  # the cosine starts at this step from this factor

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        progress = min(1.0, (step - self.decay_start) / max(1, self.total - self.decay_start))
        return self.min_ratio + (self.decay_from - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    def extend(self, step: int, total: int) -> None:
        """Plan the decay to end at `total` instead, continuing from the factor of `step` (the next step to run)."""
        if step > self.warmup:  # during warmup the cosine simply starts later, at the warmup's end as planned
            self.decay_start, self.decay_from = step, self(step)
        self.total = int(total)
