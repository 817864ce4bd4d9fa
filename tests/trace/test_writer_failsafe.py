"""The trace writer when writing goes wrong (issue 14): the disk full, the folder removed, the
event cap reached; what it leaves must say so, and nothing may raise."""
from __future__ import annotations

import os
import shutil
import stat

import pytest

from sanitizer.report.render import incomplete
from sanitizer.rules.driver import analyze
from sanitizer.trace.reader import open_trace
from sanitizer.trace.writer import TraceWriter
from trace_files import name, records

# every test in both trace formats (HAZSAN_TRACE_FORMAT, which the writer follows)
pytestmark = pytest.mark.usefixtures("trace_format")


def _lines(path):
    return records(path)


def _writer(d, monkeypatch, **kw):
    monkeypatch.setenv("RANK", "0")
    return TraceWriter(str(d), **kw)


def test_a_mark_rewrites_only_the_progress_bytes_of_the_header(tmp_path, monkeypatch):
    """A step mark writes the header's progress over its old bytes when their length is the same
    (no header rebuilt, encoded and padded); the header reads right after every mark, with its
    facts, and the events after it are untouched. A length that changes, or a new file, writes
    the whole header again."""
    w = _writer(tmp_path / "t", monkeypatch)
    w.header_source = lambda: {"hooks": {"installed": ["a", "b"], "failed": {}}}
    w.header_key = lambda: 1
    w.emit({"ev": "step", "n": 0})
    w.flush()
    w.mark_step(0, ended=True)
    built = []
    real = w._header_bytes
    monkeypatch.setattr(w, "_header_bytes", lambda h, room: built.append(h["progress"]) or real(h, room))
    body = open(w.path, "rb").read()[w._header_len:]
    for n in range(1, 60):
        w.mark_step(n, ended=False)
        header = open_trace(w.path).header
        assert header["progress"] == {"quiet": False, "step": n, "step_ended": False}
        assert header["hooks"]["installed"] == ["a", "b"]
        w.mark_step(n, ended=True)
        assert open_trace(w.path).header["progress"]["step_ended"] is True
    assert open(w.path, "rb").read()[w._header_len:] == body
    # whole headers only where the progress got longer: binary at step 128 (msgpack's fixint ends
    # at 127: never here); JSON at the first start (`false` is longer than `true`, and a shorter
    # value is padded with spaces) and when the step gets a digit (10)
    assert [p["step"] for p in built] == ([] if w.format == "binary" else [1, 10])
    w.close()


def test_a_step_end_is_flushed_when_the_last_flush_is_old_enough(tmp_path, monkeypatch):
    """end_step flushes and says the step ended only when the last flush is step_flush_seconds
    old; otherwise the header goes on saying the step runs until a later flush (a due step end,
    the time flush) has its events in the file, and the step still counts for idleness."""
    import time
    w = _writer(tmp_path / "t", monkeypatch, step_flush_seconds=3600)
    w.flush()
    w._last_flush = time.monotonic() - 7200          # the first end is due
    for n in range(4):
        w.mark_step(n, ended=False)
        w.emit({"ev": "step", "n": n})
        w.end_step(n)
        progress = open_trace(w.path).header["progress"]
        on_disk = [e["n"] for e in records(w.path)[1:] if e["ev"] == "step"]
        if n == 0:                                    # flushed, then said
            assert (progress["step"], progress["step_ended"], on_disk) == (0, True, [0])
        else:                                         # an hour has not passed: still running, unwritten
            assert (progress["step"], progress["step_ended"], on_disk) == (n, False, [0])
            assert w._idle_between_steps(time.monotonic() + w.idle_seconds)    # idle soon all the same
    w.flush()                                         # the time flush: step 3's events, then its end
    progress = open_trace(w.path).header["progress"]
    assert (progress["step"], progress["step_ended"]) == (3, True)
    assert [e["n"] for e in records(w.path)[1:] if e["ev"] == "step"] == [0, 1, 2, 3]
    w.mark_step(4, ended=False)
    w.emit({"ev": "step", "n": 4})
    w.end_step(4)
    w.mark_step(5, ended=False)                       # a start forgets the unwritten end
    w.flush()
    assert open_trace(w.path).header["progress"] == {"quiet": False, "step": 5, "step_ended": False}
    w.close()
    every = _writer(tmp_path / "e", monkeypatch, step_flush_seconds=0)
    for n in range(3):
        every.mark_step(n, ended=False)
        every.emit({"ev": "step", "n": n})
        every.end_step(n)                             # 0: every end flushed at once
        assert (open_trace(every.path).header["progress"]["step_ended"],
                len(records(every.path)) - 1) == (True, n + 1)
    every.close()


def test_clean_close_ends_with_the_end_record_and_reads_complete(tmp_path, monkeypatch):
    w = _writer(tmp_path / "t", monkeypatch)
    for n in range(5):
        w.emit({"ev": "step", "n": n})
    w.close()
    lines = _lines(w.path)
    assert lines[0]["end_record"] is True and lines[-1] == {"ev": "end", "events": 5, "dropped": 0}
    a = analyze([tmp_path / "t"])
    assert a.summary["events"] == 5 and not a.errors and incomplete(a.summary) == []
    assert stat.S_IMODE(os.stat(tmp_path / "t").st_mode) == 0o700
    assert stat.S_IMODE(os.stat(w.path).st_mode) == 0o600


def test_a_file_without_its_end_record_is_reported_truncated(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch)
    w.emit({"ev": "step", "n": 0})
    w.flush()                                  # and then the process dies: no close
    tf = open_trace(w.path)
    list(tf.events())
    assert tf.truncated and "no end record" in tf.warnings[0]
    a = analyze([w.path])
    assert not a.errors and incomplete(a.summary) == [f"1 trace(s) truncated: {w.path}"]   # named


def test_disk_full_drops_counts_and_never_raises(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch)
    w.emit({"ev": "step", "n": 0})
    w.flush()
    full = os.open("/dev/full", os.O_WRONLY)
    os.dup2(full, w._fd)
    os.close(full)
    for n in range(1, 50):
        w.emit({"ev": "step", "n": n})
    w.flush()
    w.close()
    assert w.dropped_total >= 49
    lines = _lines(w.path)
    assert [e["n"] for e in lines[1:]] == [0] and lines[-1]["ev"] != "end"
    a = analyze([w.path])
    assert f"1 trace(s) truncated: {w.path}" in incomplete(a.summary)


def test_folder_removed_mid_run_is_made_again_with_the_loss_counted(tmp_path, monkeypatch, trace_format):
    d = tmp_path / "t"
    w = _writer(d, monkeypatch)
    for n in range(10):
        w.emit({"ev": "step", "n": n})
    w.flush()
    shutil.rmtree(d)
    for n in range(10, 15):
        w.emit({"ev": "step", "n": n})
    w.close()
    lines = _lines(d / name("rank0", trace_format))
    assert {"ev": "dropped", "count": 10, "reason": "trace-file-removed"} in lines
    assert lines[-1]["ev"] == "end"
    assert [e["n"] for e in lines[1:] if e["ev"] == "step"] == list(range(10, 15))
    a = analyze([d])
    assert a.summary["dropped_events"] == 10 and a.summary["hook_errors"] == 1
    assert not a.errors and incomplete(a.summary)


def test_a_removed_file_that_held_no_event_loses_nothing(tmp_path, monkeypatch, trace_format):
    """A launcher's folder cleaned by the program it starts (examples/mhc_decode's --out): the file
    held its header alone, so it is made again and the capture stays complete."""
    d = tmp_path / "t"
    w = _writer(d, monkeypatch)
    w.open_now()                       # the header alone, as capture writes it at torch's import
    assert (d / name("rank0", trace_format)).exists()
    shutil.rmtree(d)
    w.emit({"ev": "step", "n": 1})
    w.close()
    lines = _lines(d / name("rank0", trace_format))
    assert [e["ev"] for e in lines[1:]] == ["step", "end"]
    a = analyze([d])
    assert a.summary["dropped_events"] == 0 and a.summary["hook_errors"] == 0 and not incomplete(a.summary)


def test_past_the_event_cap_the_file_stops_growing(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch, max_events=10)
    for n in range(2000):
        w.emit({"ev": "step", "n": n})
        if n % 5 == 0:
            w.flush()                          # a step marker's flush: 400 of them past the cap
    w.close()
    lines = _lines(w.path)
    assert len(lines) <= 1 + 10 + 3            # header, the cap, a drop record or two, the end
    drops = sum(e["count"] for e in lines[1:] if e["ev"] == "dropped")
    assert drops == 1990 and lines[-1] == {"ev": "end", "events": len(lines) - 2, "dropped": 1990}


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc/self/fd")
def test_step_progress_is_written_through_one_kept_descriptor(tmp_path, monkeypatch, trace_format):
    """Marking steps rewrites the header twice a step through a second descriptor opened once per
    file (the first appends); the header on disk says each mark at once; a file made again after
    its folder was removed gets its own descriptor, and closing leaves none open."""
    d = tmp_path / "t"
    before = _open_fds()
    w = _writer(d, monkeypatch)
    w.emit({"ev": "step", "n": 0})
    w.flush()
    w.mark_step(0, ended=True)
    during = _open_fds()
    assert during == before + 2                   # the file's descriptor and the header's
    for n in range(1, 30):
        w.mark_step(n, ended=False)
        w.emit({"ev": "step", "n": n})
        assert open_trace(w.path).header["progress"]["step_ended"] is False
        w.flush()
        w.mark_step(n, ended=True)
        progress = open_trace(w.path).header["progress"]
        assert (progress["step"], progress["step_ended"]) == (n, True)
        assert _open_fds() == during              # no descriptor opened per header write
    shutil.rmtree(d)
    w.mark_step(30, ended=False)                  # the old file is gone: no header written to it
    w.emit({"ev": "step", "n": 30})
    w.flush()                                     # made again
    w.mark_step(30, ended=True)
    progress = open_trace(w.path).header["progress"]
    assert (progress["step"], progress["step_ended"]) == (30, True)
    assert _open_fds() == during
    w.close()
    assert _open_fds() == before


def test_the_time_flush_sleeps_on_a_pipe_that_a_set_after_close_never_writes_to():
    """The time flush's Kick: a set wakes the sleeper (also written from C++, the native idle
    watch), a wait forgets every wake-up so far, and once the time flush closed it a late set (a
    step hook racing the shutdown) neither raises nor writes into a descriptor reused since."""
    import time

    from sanitizer.trace.flush_timer import Kick
    kick = Kick()
    t = time.monotonic()
    kick.wait(0.05)                                     # nothing set: the whole timeout
    assert time.monotonic() - t >= 0.04
    for _ in range(3):
        kick.set()
    os.write(kick.w, b"w")                              # as the idle watch writes
    t = time.monotonic()
    kick.wait(5.0)
    assert time.monotonic() - t < 1.0                   # woken at once
    t = time.monotonic()
    kick.wait(0.05)                                     # every wake-up was consumed
    assert time.monotonic() - t >= 0.04
    kick.close()
    reused_r, reused_w = os.pipe()                      # may take the closed descriptors' numbers
    try:
        kick.set()
        kick.close()
        os.set_blocking(reused_r, False)
        with pytest.raises(BlockingIOError):
            os.read(reused_r, 1)                        # nothing written into whatever has them now
    finally:
        os.close(reused_r)
        os.close(reused_w)
