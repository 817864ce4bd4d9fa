"""The trace writer must not inflate the host's peak memory when it flushes a full buffer."""
import subprocess
import sys

import pytest

from trace_files import name, records

PROBE = r"""
import resource, sys
from sanitizer.trace.writer import TraceWriter
w = TraceWriter(sys.argv[1], buffer_events=65536, flush_seconds=1e9)
w.set_rank(0, 1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for i in range(65536):
    w.emit({"ev": "alloc", "id": i, "addr": i * 512, "size": 512, "stream": "cpu", "pool": 0, "site": "x.py:1:f"})
w.close()
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024)
"""


@pytest.mark.usefixtures("trace_format")
def test_flushing_65k_events_costs_little_memory(tmp_path, trace_format):
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path)], capture_output=True, text=True, check=True)
    grown_mb = float(r.stdout.strip().splitlines()[-1])
    # The buffered events themselves take ~20 MB; encoding them all at once took ~270 MB more.
    assert grown_mb < 80, grown_mb
    lines = records(tmp_path / name("rank0", trace_format))
    assert len(lines) == 65538 and lines[-2]["id"] == 65535
    assert lines[-1] == {"ev": "end", "events": 65536, "dropped": 0}  # a clean close's last record
