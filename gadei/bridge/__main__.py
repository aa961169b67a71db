"""`python -m gadei.bridge SIZES REPEATS`: `gadei bench bridge`'s measurement under mpiexec."""

import sys

from .measurement import main

sys.exit(main(sys.argv[1:]))
