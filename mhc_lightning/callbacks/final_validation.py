"""FinalValidation: every fit ends with a validation pass, so its last val metrics describe the final weights.

Lightning validates every `val_check_interval` steps only: with max_steps below the interval, or not a
multiple of it, a fit ends on steps it never validated (or with no val metric at all). Raising
`trainer.should_stop` on the last batch asks the loop for the validation it runs before an early stop;
when the last step is a validation step anyway, that is the same single pass, never a second one.
"""

from lightning.pytorch.callbacks import Callback


class FinalValidation(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._last_batch(trainer, batch_idx):
            trainer.should_stop = True

    @staticmethod
    def _last_batch(trainer, batch_idx: int) -> bool:
        if trainer.max_steps > 0 and trainer.global_step >= trainer.max_steps:  # -1: no step limit
            return True
        return (
            trainer.max_epochs is not None
            and trainer.max_epochs >= 0
            and trainer.current_epoch == trainer.max_epochs - 1
            and batch_idx + 1 >= trainer.num_training_batches
        )
