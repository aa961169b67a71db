"""`python -m gadei` runs the `gadei` command (how launch.py starts servers and learners)."""

import sys

from .cli import main

sys.exit(main())
