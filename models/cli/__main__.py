"""`python -m models.cli`: the `boundary-jax` command line."""

import sys

from .entry import main

sys.exit(main())
