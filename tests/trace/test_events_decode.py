"""Decoding trace lines into typed events (sanitizer/trace/events.py, msgspec)."""
from __future__ import annotations

import pytest

from sanitizer.trace import events as E
from sanitizer.trace.schema import COMMON_FIELDS, EVENT_FIELDS


def test_the_typed_events_are_the_schema():
    assert set(E.BY_KIND) == set(EVENT_FIELDS)
    for kind, fields in EVENT_FIELDS.items():
        assert E.FIELDS[kind] == fields | COMMON_FIELDS, kind


def decode(*lines: bytes):
    d = E.EventDecoder()
    problems: list = []
    cut: list = []
    events = d.decode(2, list(lines), problems, on_cut=cut.append)
    return d, events, problems, cut


def test_fields_arrive_typed():
    _, [ev], problems, _ = decode(b'{"ev":"coll","cid":3,"comm":"tp","seq":7,"op":"all_reduce","stream":2,'
                                  b'"bufs":[{"addr":4096,"size":64,"access":"rw"}],"site":"m.py:1:f"}\n')
    assert problems == [] and type(ev) is E.Coll
    assert (ev.cid, ev.seq, ev.stream, ev.site) == (3, 7, 2, "m.py:1:f")
    assert ev.bufs == [E.Buf(addr=4096, size=64, access="rw")]


@pytest.mark.parametrize("line,message", [
    (b'{"ev":"alloc","id":5,"addr":"0x10","size":4,"stream":"s0","pool":0}', "alloc: field 'addr' must be an integer, got str"),
    (b'{"ev":"launch"}', "launch: missing field 'stream'"),
    (b'{"ev":"coll","cid":1,"comm":"tp","seq":1,"op":"x","stream":"c","bufs":[{"addr":1,"access":"r"}]}', "coll: missing field 'bufs[0].size'"),
    (b'{"ev":"scope","name":"x","enter":1}', "scope: field 'enter' must be true or false, got int"),
    (b'{"ev":"free","id":[1]}', "free: field 'id' must be an integer or a string, got array"),
    (b'{"ev":"launch","stream":"s0","reads":[[1]]}', "'reads' and 'writes' must be lists of [addr, size] integer pairs"),
    (b'{"ev":"coll","cid":1,"comm":"tp","seq":1,"op":"x","stream":"c","bufs":[{"addr":1,"size":1,"access":"x"}]}', "bufs[0].access"),
    (b'{"ev":"alloc","id":1,"addr":-1,"size":4,"stream":"s0","pool":0}', "field 'addr' must be an integer >= 0"),
    (b'{"t":5}', "missing field 'ev'"),
    (b'{"ev":["alloc"]}', "field 'ev' must be a string"),
    (b'[1,2]', "an event must be a JSON object"),
    (b'{not json', "not JSON"),
])
def test_a_bad_field_is_one_line_naming_it(line, message):
    _, events, problems, _ = decode(b'{"ev":"step","n":1}\n', line + b"\n")
    assert type(events[0]) is E.Step and events[1] is None
    assert len(problems) == 1 and problems[0][0] == 3 and message in problems[0][1], problems
    assert "\n" not in problems[0][1]


def test_unknown_kinds_and_fields_are_counted_and_the_rest_decoded():
    d, events, problems, _ = decode(b'{"ev":"kernel_profile","name":"x"}\n',
                                    b'{"ev":"free","id":1,"color":"blue","shade":2}\n',
                                    b'{"ev":"free","id":"x","color":1}\n')
    assert problems == [] and events[0] is None and events[1] == E.Free(id=1) and events[2] == E.Free(id="x")
    assert (d.unknown_kinds, d.unknown_fields) == ({"kernel_profile": 1}, {"color": 2, "shade": 1})
    # an unknown field does not hide a bad known one
    _, _, problems, _ = decode(b'{"ev":"free","id":1.5,"color":"blue"}\n')
    assert problems == [(2, "free: field 'id' must be an integer or a string, got float")]


def test_blank_lines_and_a_cut_last_line():
    _, events, problems, cut = decode(b'\n', b'{"ev":"step","n":1}\n', b'{"ev":"fre')
    assert events == [None, E.Step(n=1)] and problems == [] and cut == [4]


def test_address_range_covers_the_modelled_windows():
    from sanitizer.capture.window import WINDOW_BASE

    line = b'{"ev":"window","addr":%d,"size":%d,"comm":"tp"}\n'
    _, [ev], problems, _ = decode(line % (WINDOW_BASE + 4096, 1 << 40))
    assert problems == [] and ev.addr == WINDOW_BASE + 4096
    _, _, problems, _ = decode(line % (3 << 61, 64))   # beyond: the end would not fit 64 bits
    assert problems and "field 'addr' must be an integer" in problems[0][1]
