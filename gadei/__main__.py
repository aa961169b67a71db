"""`python -m gadei` runs the `gadei` command (how launch.py starts servers and learners)."""

from .cli import main
from .console import leave

leave(main())
