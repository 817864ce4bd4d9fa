"""Any line, any value: decoding and both engines give events, counted warnings or one-line
problems, never an exception (hypothesis; the schema's kinds and fields with values of any JSON
type, so that type errors, bounds and state errors all occur)."""
from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sanitizer.rules.driver import analyze, compiled_available
from sanitizer.trace.schema import COMMON_FIELDS, EVENT_FIELDS

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]

scalars = st.one_of(st.none(), st.booleans(), st.integers(min_value=-(1 << 70), max_value=1 << 70),
                    st.integers(min_value=0, max_value=64), st.floats(allow_nan=False), st.text(max_size=4),
                    st.sampled_from(["s0", "s1", "r", "w", "rw", "tp"]))
values = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                       st.dictionaries(st.sampled_from(["addr", "size", "access", "x"]), inner, max_size=3)),
                      max_leaves=6)
KINDS = sorted(EVENT_FIELDS) + ["mystery"]


@st.composite
def event_line(draw):
    kind = draw(st.sampled_from(KINDS))
    names = sorted(EVENT_FIELDS.get(kind, set()) | COMMON_FIELDS - {"ev"}) + ["extra"]
    ev = {"ev": kind}
    for name in draw(st.lists(st.sampled_from(names), max_size=8, unique=True)):
        ev[name] = draw(values)
    return json.dumps(ev)


lines = st.lists(st.one_of(event_line(), event_line(), st.text(max_size=12)), max_size=25)


@pytest.mark.parametrize("engine", ENGINES)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=lines)
def test_no_line_makes_hazsan_raise(tmp_path, engine, body):
    p = tmp_path / "fuzz.jsonl"
    p.write_text('{"hazsan": 1, "rank": 0}\n' + "".join(line.replace("\n", " ") + "\n" for line in body))
    a = analyze([p], engine=engine, lenient=False)
    assert a.exit_code() in (0, 1, 2)
    for e in a.errors:
        assert str(e).startswith(f"{p}:") and "\n" not in str(e)
    lenient = analyze([p], engine=engine, lenient=True)
    # lenient: never unusable, but a body that counts dropped events or hook failures gives no verdict
    assert lenient.exit_code() in ((0, 1, 2) if lenient.blockers() else (0, 1))
    assert not lenient.errors and lenient.summary["skipped_lines"] == a.summary["malformed"]
