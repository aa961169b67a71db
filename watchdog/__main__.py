"""`python -m gadei_watchdog JOB --checkpoint-dir DIR ...` or `JOB --job-file FILE`: a job's supervisor."""

from gadei.console import leave

from .cli import main

leave(main())
