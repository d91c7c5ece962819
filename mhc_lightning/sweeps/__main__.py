"""`python -m mhc_lightning.sweeps ...` == `mhc sweep ...` (worker processes are started this way)."""

import sys

from .cli import main

sys.exit(main())
