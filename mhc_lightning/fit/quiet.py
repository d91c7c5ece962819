"""Messages a fit printed that tell the user nothing they can act on, silenced by their exact text or switch (nothing
else is filtered):

- Lightning's "💡 Tip: ... try installing litlogger ..." (an advertisement, logged at INFO for any logger but its own);
- torch's FutureWarning "`isinstance(treespec, LeafSpec)` is deprecated", raised inside Lightning's own _pytree code
  (nothing in this project to change; Lightning will follow torch);
- MLflow's "Downloading artifacts" progress bars, one per append to a run's table (the stability events), between
  the event lines (MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR, unless the user set it).
"""

from __future__ import annotations

import logging
import os
import warnings

LITLOGGER_TIP = "💡 Tip: For seamless cloud logging"
LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"


class _DropTip(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(LITLOGGER_TIP)


_TIP_FILTER = _DropTip()


def silence_known_noise() -> None:
    """Idempotent: filters are added once per process."""
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning_utilities.core.rank_zero"):
        logger = logging.getLogger(name)
        if _TIP_FILTER not in logger.filters:
            logger.addFilter(_TIP_FILTER)
    warnings.filterwarnings("ignore", message=LEAFSPEC, category=FutureWarning)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
