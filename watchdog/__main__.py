"""`python -m gadei_watchdog JOB --checkpoint-dir DIR ...`"""

import sys

from . import main

sys.exit(main())
