"""asymmetric-offset across ranks that reach a communicator at very different points of their
files (issue 14): every (comm, seq) seen on two or more ranks is compared, whatever the lag."""
from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from sanitizer.rules.driver import analyze, compiled_available, load_engine

ENGINES = ["interpreted", "compiled"] if compiled_available()[0] else ["interpreted"]
WIN = 1 << 30


def write_ranks(tmp: Path, lead: dict, mismatch_seq=2, comms=None, colls=3, world=2) -> list[Path]:
    """Rank r: a window, `lead[r]` launches without buffers, then collectives seq 1..colls on
    each communicator of comms[r]; rank 1 uses offset 256 at `mismatch_seq`, the others 0."""
    paths = []
    for r in range(world):
        p = tmp / f"rank{r}.jsonl"
        lines = [{"hazsan": 1, "rank": r, "world_size": world}]
        my_comms = (comms or {}).get(r, ["tp"])
        base = {c: WIN + (i << 21) for i, c in enumerate(["tp", "pp"])}
        for c in my_comms:
            lines.append({"ev": "window", "addr": base[c], "size": 1 << 20, "comm": c})
        lines += [{"ev": "launch", "stream": 1, "op": "k"}] * lead.get(r, 0)
        cid = 0
        for seq in range(1, colls + 1):
            for c in my_comms:
                cid += 1
                off = 256 if (r == 1 and seq == mismatch_seq) else 0
                lines.append({"ev": "coll", "cid": cid, "comm": c, "seq": seq, "op": "all_reduce", "stream": 2,
                              "bufs": [{"addr": base[c] + off, "size": 64, "access": "rw"}]})
        lines.append({"ev": "sync"})
        p.write_bytes(b"\n".join(orjson.dumps(x) for x in lines) + b"\n")
        paths.append(p)
    return paths


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("lead", [0, 30_000])
def test_late_rank_is_compared(tmp_path, engine, lead):
    """Rank 1 first uses the communicator after `lead` other events (30,000: about 8 read rounds
    after rank 0 finished): its mismatch at seq 2 is found and nothing is left unmatched."""
    a = analyze([str(p) for p in write_ranks(tmp_path, {1: lead})], engine=engine)
    assert a.summary["engine"] == engine
    assert a.summary["by_rule"] == {"asymmetric-offset": 1}
    f = a.findings[0]
    assert (f.rank, f.line) == (1, 2 + lead + 2)
    assert not any("not seen on every rank" in w for w in a.warnings), a.warnings


@pytest.mark.parametrize("engine", ENGINES)
def test_early_rank_lagging_behind_is_compared(tmp_path, engine):
    """The reference rank itself is the late one."""
    a = analyze([str(p) for p in write_ranks(tmp_path, {0: 30_000})], engine=engine)
    assert a.summary["by_rule"] == {"asymmetric-offset": 1}
    assert not any("not seen on every rank" in w for w in a.warnings), a.warnings


@pytest.mark.parametrize("engine", ENGINES)
def test_subset_communicator_with_a_late_member(tmp_path, engine):
    """Ranks 0 and 1 share "pp"; rank 2 never uses it. Rank 1 reaches it 30,000 events late:
    the references wait for it (rank 2 could still have joined until its file ended)."""
    comms = {0: ["tp", "pp"], 1: ["tp", "pp"], 2: ["tp"]}
    a = analyze([str(p) for p in write_ranks(tmp_path, {1: 30_000}, comms=comms, world=3)], engine=engine)
    assert a.summary["by_rule"] == {"asymmetric-offset": 2}  # seq 2 on tp and on pp
    assert {f.detail.split(" seq")[0] for f in a.findings} == {"'tp'", "'pp'"}
    assert not any("not seen on every rank" in w for w in a.warnings), a.warnings


class _Rank:
    def __init__(self, rank):
        self.rank, self.file, self.step = rank, f"rank{rank}.jsonl", None


class _Op:
    def __init__(self, line):
        self.line, self.site, self.kind, self.name, self.stream = line, None, "coll", "all_reduce", 2
        self.cid, self.comm, self.seq, self.step = line, "tp", line, None
        self.stack = self.captured = None


@pytest.mark.parametrize("engine", ENGINES)
def test_references_bounded_late_rank_counted_unmatched(engine):
    """Past max_retained the oldest references go; the late rank's collectives then count as
    unmatched (the driver's warning), never as compared-and-clean."""
    from sanitizer.rules.findings import FindingSink

    eng = load_engine(engine)[0]
    sink = FindingSink(max_per_group=0)
    m = eng.CollectiveMatcher(sink, enabled=True, ranks={0, 1}, max_retained=10)
    r0, r1 = _Rank(0), _Rank(1)
    for seq in range(1, 101):
        m.submit(r0, "tp", seq, _Op(seq), ((0, 0, 64),))
        m.end_round()
    assert m.retained == 10 and m.dropped == 90
    for seq in range(1, 101):
        m.submit(r1, "tp", seq, _Op(seq), ((0, 256, 64),))
    m.rank_finished(0)
    m.rank_finished(1)
    m.end_round()
    m.finish()
    assert sink.by_rule.get("asymmetric-offset") == 10  # the 10 still held were compared
    assert m.unmatched == 90


@pytest.mark.parametrize("engine", ENGINES)
def test_references_kept_until_every_rank_reported_them(engine):
    """A reference stays while a rank may still report it (not a member yet, or a member that is
    behind), and goes as soon as every rank of the communicator has."""
    from sanitizer.rules.findings import FindingSink

    eng = load_engine(engine)[0]
    m = eng.CollectiveMatcher(FindingSink(max_per_group=0), enabled=True, ranks={0, 1})
    r0, r1 = _Rank(0), _Rank(1)
    for seq in range(1, 50):
        m.submit(r0, "tp", seq, _Op(seq), ())
        m.end_round()
    assert m.retained == 49  # rank 1 may still join
    m.submit(r1, "tp", 1, _Op(1), ())
    m.end_round()
    assert m.retained == 48  # rank 1 is a member now, behind by 48
    for seq in range(2, 50):
        m.submit(r1, "tp", seq, _Op(seq), ())
    assert m.retained == 0
    m.submit(r0, "tp", 50, _Op(50), ())
    m.submit(r1, "tp", 50, _Op(50), ())
    m.end_round()
    assert m.retained == 0 and not m.pending  # both reported within a round: never kept
    m.finish()
    assert m.unmatched == 0


@pytest.mark.parametrize("engine", ENGINES)
def test_killed_rank_is_not_waited_for(tmp_path, engine):
    """Rank 2's file ends after 5 collectives (a killed rank). The others' 20,000 are compared
    among themselves round by round (a mismatch late in the run is found), counted unmatched, and
    not held until the end: the pending table stays small."""
    paths = write_ranks(tmp_path, {}, mismatch_seq=15_000, colls=20_000, world=3)
    lines = paths[2].read_bytes().splitlines(keepends=True)
    paths[2].write_bytes(b"".join(lines[:2 + 5]))  # header, window, 5 collectives
    eng = load_engine(engine)[0]
    peak = [0]

    class Watched(eng.CollectiveMatcher):
        def end_round(self):
            super().end_round()
            peak[0] = max(peak[0], len(self.pending), self.retained)

    a = analyze([str(p) for p in paths], engine=engine, matcher=Watched)
    assert a.summary["by_rule"] == {"asymmetric-offset": 1}
    assert (a.findings[0].rank, a.findings[0].line) == (1, 2 + 15_000)
    assert "19995 collective(s) were not seen on every rank of their communicator" in a.warnings
    assert peak[0] < 10_000, peak[0]  # a round's worth, not the 19,995 collectives rank 2 never brought
