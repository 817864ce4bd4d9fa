"""The writer's `thread` events (sanitizer/trace/writer.py, "Threads"; docs/capture.md "Host
threads"): an event from another thread than the last one's is preceded by a switch, the main
thread is 0, and a file always starts on the thread of its first event, whatever was cut, lost or
rotated before it. Both trace formats."""
from __future__ import annotations

import threading

import pytest

from sanitizer.trace.writer import TraceWriter
from trace_files import records

pytestmark = pytest.mark.usefixtures("trace_format")


def _writer(d, monkeypatch, **kw):
    monkeypatch.setenv("RANK", "0")
    w = TraceWriter(str(d), **kw)
    w.start()
    return w


def _on_thread(fn):
    out = {}

    def run():
        out["ident"] = threading.get_ident()
        fn()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out["ident"]


def _threads(evs):
    """(thread, n) of each step event, the current thread followed through the switches."""
    cur, out = 0, []
    for ev in evs:
        if ev.get("ev") == "thread":
            cur = ev["thread"]
        elif ev.get("ev") == "step":
            out.append((cur, ev["n"]))
    return out


def test_switches_only_where_the_thread_changes_main_is_zero(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch)
    w.emit({"ev": "step", "n": 0})
    k = _on_thread(lambda: (w.emit({"ev": "step", "n": 1}), w.emit({"ev": "step", "n": 2})))
    w.emit({"ev": "step", "n": 3})
    w.emit_many([{"ev": "step", "n": 4}, {"ev": "step", "n": 5}], thread=k)
    w.emit_on({"ev": "step", "n": 6}, k)
    w.emit_on({"ev": "step", "n": 7}, threading.main_thread().ident)
    w.close()
    evs = records(w.path)[1:]
    assert [ev for ev in evs if ev["ev"] == "thread"] == [{"ev": "thread", "thread": t} for t in (k, 0, k, 0)]
    assert _threads(evs) == [(0, 0), (k, 1), (k, 2), (0, 3), (k, 4), (k, 5), (k, 6), (0, 7)]
    assert evs[0] == {"ev": "step", "n": 0}          # the main thread needs no switch at the start


def test_a_new_file_starts_on_the_thread_of_its_first_event(tmp_path, monkeypatch):
    """A rotation (reopen) after another thread's events, its preamble first: the new file says
    where the writer is (the old one ended on thread k)."""
    w = _writer(tmp_path / "a", monkeypatch)
    k = _on_thread(lambda: (w.emit({"ev": "step", "n": 1}), w.flush(), w.emit({"ev": "step", "n": 2})))
    old = w.path
    w.reopen(str(tmp_path / "b"), preamble=[{"ev": "step", "n": 99}])
    w.emit({"ev": "step", "n": 3})
    w.close()
    assert _threads(records(old)[1:]) == [(k, 1), (k, 2)]
    assert _threads(records(w.path)[1:]) == [(k, 99), (0, 3)]


def test_past_the_cap_and_after_a_lost_batch_the_threads_stay_right(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch, max_events=4)
    k = _on_thread(lambda: [w.emit({"ev": "step", "n": n}) for n in range(3)])
    w.flush()                     # a switch and 3 events: the cap
    w.emit({"ev": "step", "n": 10})
    w.flush()                     # dropped and counted
    w.close()
    evs = records(w.path)[1:]
    assert _threads(evs) == [(k, 0), (k, 1), (k, 2)]
    assert any(ev["ev"] == "dropped" for ev in evs)


def test_a_failed_write_is_followed_by_a_switch_again(tmp_path, monkeypatch):
    w = _writer(tmp_path, monkeypatch)
    w.emit({"ev": "step", "n": 0})
    w.flush()
    real = w._encode
    calls = {"n": 0}

    def failing(part, packed=False):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(28, "No space left on device")
        return real(part, packed)
    monkeypatch.setattr(w, "_encode", failing)
    k = _on_thread(lambda: w.emit({"ev": "step", "n": 1}))
    w.flush()                     # lost: the switch to k with it
    _on_thread(lambda: None)
    w.emit_on({"ev": "step", "n": 2}, k)     # the writer thinks k is current: the file does not
    w.close()
    assert _threads(records(w.path)[1:]) == [(0, 0), (k, 2)]
