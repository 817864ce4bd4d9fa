"""`python -m sanitizer ...` is the same as the `hazsan` console script."""
import sys

from sanitizer.cli import main

sys.exit(main())
