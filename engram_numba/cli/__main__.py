"""`python -m engram_numba.cli`: the `engram-numba` command."""
import sys

from . import main

sys.exit(main())
