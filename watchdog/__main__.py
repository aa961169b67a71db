"""`python -m gadei_watchdog JOB --checkpoint-dir DIR ...` or `--job-file FILE`: a job's supervisor."""

import sys

from .cli import main

sys.exit(main())
