import os
import sys
from pathlib import Path

# An internal error in a command propagates with its traceback (sanitizer/cli.py would print one
# line and exit 2): a test that only checks the exit code must not pass over a bug. Subprocesses
# the tests start inherit it.
os.environ["HAZSAN_RAISE"] = "1"

# tests/ helpers (tracebuilder, reference_model) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
