"""ResumableRandomSampler: torch's RandomSampler (the same shuffle, batch for batch) whose position can be saved and
restored, so that a run resumed from a checkpoint continues on exactly the batches an uninterrupted run would see.

torchdata's StatefulDataLoader saves a sampler's state_dict in the loader's state, and Lightning saves that in every
checkpoint (no "dataloader is not resumable" warning). torchdata's own shuffling sampler would do the saving too, but
draws its permutations in another order than torch's, which would change the data order of every run; this one keeps
torch's and adds only the state: the generator at the start of the epoch and the indices handed out since.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Optional

import torch
from torch.utils.data import RandomSampler


class ResumableRandomSampler(RandomSampler):
    def __init__(self, data_source, generator: torch.Generator):
        super().__init__(data_source, generator=generator)
        self._epoch_state: Optional[torch.Tensor] = None
        self._yielded = 0
        self._resume: Optional[tuple[torch.Tensor, int]] = None

    def __iter__(self) -> Iterator[int]:
        skip = 0
        if self._resume is not None:  # restored: replay the epoch's permutation, drop what was already trained
            state, skip = self._resume
            self._resume = None
            self.generator.set_state(state)
        self._epoch_state, self._yielded = self.generator.get_state(), 0
        for i, index in enumerate(super().__iter__()):
            if i < skip:
                continue
            self._yielded = i + 1
            yield index

    def state_dict(self) -> dict:
        return {"generator": self._epoch_state, "yielded": self._yielded}

    def load_state_dict(self, state_dict: dict) -> None:
        self._resume = (state_dict["generator"], state_dict["yielded"])
