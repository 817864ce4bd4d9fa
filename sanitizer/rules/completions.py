"""When each op becomes done, told by the engine itself (docs/ordering-and-rules.md, "When is an op
done", "What the analysis keeps"): what the HTML report's bars and the Perfetto export's
collective slices are drawn from, so that they end where the findings say the op stops being in
flight, under either `--peer-completion` mode.

An op is reported done at the line where it becomes done for the host: from then on no stream can
see it unfinished, and no finding can name it. That is the engine's own retirement, by its clocks
and its rule:

* `local`, and every op but a collective's window buffers under `successor`: locally complete for
  the host (a `coll_done`, a `sync`, a `free_done` taught the host its epoch). Ops without buffers
  (a collective with empty `bufs`) are done by the same rule, though the engine keeps none of them.
* `successor`, a collective with window buffers: when the engine retires it, locally complete for
  the host and a later collective on its communicator too.

`Completions` is the engine's listener (RankAnalyzer.listen); `CompletionReplay` replays one rank
file through the engine a line at a time, beside a renderer that reads the same file.
"""
from __future__ import annotations

from collections import deque

from sanitizer.trace.reader import TraceError, TypedEvents, open_trace

LOCAL = "local"


class Completions:
    """Listens to one RankAnalyzer: calls `on_complete(op, line)` once for each op it enqueues,
    at the line where the op becomes done for the host (the engine's Op: .kind, .line of its
    launch, coll or graph_replay, .stream, .cid)."""

    __slots__ = ("analyzer", "on_complete", "pending")

    def __init__(self, analyzer, on_complete):
        self.analyzer = analyzer
        self.on_complete = on_complete
        # stream -> its ops not yet done for the host under the local rule, in epoch order
        self.pending: dict = {}
        analyzer.listen(self)

    def enqueued(self, op) -> None:
        if op.window_bufs:
            return  # successor mode's window buffers: the engine says when (successor_done)
        queue = self.pending.get(op.stream)
        if queue is None:
            queue = self.pending[op.stream] = deque()
        queue.append(op)

    def host_learned(self, learned) -> None:
        """The host clock grew for the streams `learned` (None: any)."""
        host = self.analyzer.clocks.host
        line = self.analyzer.line
        pending = self.pending
        for stream in (list(pending) if learned is None else learned):
            queue = pending.get(stream)
            if not queue:
                continue
            known = host.get(stream, 0)
            while queue and queue[0].epoch <= known:
                self.on_complete(queue.popleft(), line)
            if not queue:
                del pending[stream]

    def successor_done(self, ops) -> None:
        line = self.analyzer.line
        for op in ops:
            self.on_complete(op, line)


class _Unreported:
    """The replay's findings go nowhere: the analysis that the rendering shows made them."""

    def add(self, finding) -> None:
        pass


class CompletionReplay:
    """One rank file applied to the engine up to a line at a time (`upto`), so that a renderer
    reading the same file hears `on_complete(op, line)` as it reaches `line`. Lines the engine
    rejects are skipped (`hazsan check` reports them)."""

    def __init__(self, path, on_complete, *, peer_completion: str = LOCAL, engine: str | None = None,
                 limits=None):
        """`limits` (sanitizer.limits.Limits; default: its defaults): as for `analyze`."""
        from sanitizer.limits import Limits
        from sanitizer.rules.driver import CHUNK, RankReader, new_analyzer
        from sanitizer.rules.select import load_engine

        eng, _, _ = load_engine(engine)
        self.engine = eng
        limits = limits or Limits()
        trace = open_trace(path, limits)
        sink = _Unreported()
        self.analyzer = new_analyzer(eng, str(path), trace.rank, sink, eng.CollectiveMatcher(sink, enabled=False),
                                     peer_completion, limits)
        Completions(self.analyzer, on_complete)
        self.reader = RankReader(trace, self.analyzer)
        self.source: TypedEvents = self.reader.source
        self.items: list = []
        self.pos = 0
        self.next_line = 0  # the line of items[pos]; 0 before the first batch
        self.ended = False

    def upto(self, line: int) -> None:
        """Apply every event up to and including `line`."""
        problems: list = []
        while not self.ended and self.next_line <= line:
            if self.pos >= len(self.items):
                try:
                    self.next_line, self.items = self.source.next(problems)
                except (StopIteration, TraceError):
                    self.ended = True
                    return
                self.pos = 0
                continue
            n = min(len(self.items) - self.pos, line - self.next_line + 1)
            self.analyzer.feed_batch(self.next_line, self.items[self.pos:self.pos + n], problems)
            self.pos += n
            self.next_line += n
            problems.clear()

    def close(self) -> None:
        self.reader.forget(self.engine)
        self.reader.trace.close()
