"""`python -m models.cli`: the `boundary-jax` command line."""

import sys

from .main import main

sys.exit(main())
