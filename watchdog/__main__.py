"""`python -m gadei_watchdog JOB --checkpoint-dir DIR ...`: the same as `gadei watchdog JOB ...`."""

import sys

from .cli import main

sys.exit(main())
