import sys
from pathlib import Path

# tests/ helpers (tracebuilder, reference_model) import as plain modules.
sys.path.insert(0, str(Path(__file__).parent))
