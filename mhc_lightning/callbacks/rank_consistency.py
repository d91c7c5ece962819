"""RankConsistencyCheck: every rank holds the same weights and optimizer state, checked by digest."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal, Optional, get_args

from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn

from ..training.distributed import ranks_in_sync, sharded

OnMismatch = Literal["raise", "warn"]


class RankConsistencyCheck(Callback):
    """Check that every rank holds the same weights and optimizer state (DDP's invariant).

    Cheap enough for every run at fit end (one hash of the state per rank, one small all_gather); with
    `every_n_steps` also during training, e.g. right after rollbacks or other callbacks that touch weights.

    Args:
        every_n_steps: also check after every n-th optimizer step (0 = only at the end of fit).
        on_mismatch: "raise" (RuntimeError naming the ranks that differ) or "warn".
        dirpath: each rank also writes rank<r>.json there (global_step and digests), for tests and post-mortems.
    """

    def __init__(self, every_n_steps: int = 0, on_mismatch: OnMismatch = "raise", dirpath: Optional[str] = None):
        super().__init__()
        if not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"RankConsistencyCheck.every_n_steps must be an integer >= 0, got {every_n_steps!r}")
        if on_mismatch not in get_args(OnMismatch):
            raise ValueError(f"RankConsistencyCheck.on_mismatch must be 'raise' or 'warn', got {on_mismatch!r}")
        self.every_n_steps, self.on_mismatch = every_n_steps, on_mismatch
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.checks = 0
        self.mismatch_steps: list[int] = []
        self._warned_sharded = False

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        k = self.every_n_steps
        if k and trainer.global_step % k == 0:
            self.check(trainer, pl_module)

    def on_train_end(self, trainer, pl_module) -> None:
        self.check(trainer, pl_module)

    def check(self, trainer, pl_module) -> bool:
        if sharded(trainer):
            if not self._warned_sharded:
                self._warned_sharded = True
                rank_zero_warn(
                    f"RankConsistencyCheck: {type(trainer.strategy).__name__} shards the state across "
                    "ranks; nothing to compare."
                )
            return True
        ok, everyone = ranks_in_sync(trainer, pl_module)
        self.checks += 1
        step = trainer.global_step
        if not ok:
            self.mismatch_steps.append(step)
        if self.dirpath is not None:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            record = {
                "rank": trainer.global_rank,
                "world_size": trainer.world_size,
                "global_step": step,
                **everyone[trainer.global_rank],
                "in_sync": ok,
                "checks": self.checks,
                "mismatch_steps": self.mismatch_steps,
            }
            (self.dirpath / f"rank{trainer.global_rank}.json").write_text(json.dumps(record, indent=1))
        if trainer.global_rank == 0:
            for lg in trainer.loggers:
                lg.log_metrics({"dist/ranks_in_sync": float(ok)}, step=step)
        if not ok:
            differ = [r for r, d in enumerate(everyone) if d != everyone[0]]
            msg = (
                f"RankConsistencyCheck: at global_step {step} ranks {differ} hold different weights or optimizer "
                f"state than rank 0 (digests {everyone}). Something changed the state on some ranks only, "
                "e.g. a callback acting on a rank-local value without a collective decision."
            )
            if self.on_mismatch == "raise":
                raise RuntimeError(msg)
            rank_zero_warn(msg)
        return ok
