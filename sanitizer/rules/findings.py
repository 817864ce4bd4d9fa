"""Finding records and the rule table (docs/ordering-and-rules.md, "The rules" and "The finding record")."""
from __future__ import annotations

from dataclasses import dataclass, field

ERROR, WARNING = "error", "warning"
SEVERITY_ORDER = {ERROR: 0, WARNING: 1}

#: rule -> (severity, one-line meaning). The order is the report order within a severity.
RULES: dict[str, tuple[str, str]] = {
    "reuse-in-flight": (ERROR, "a block was allocated over a buffer of an op not done for its stream (the realised collision)"),
    "unordered-access": (ERROR, "an op accesses a range that an op not done for its stream writes (or reads, if it writes)"),
    "graph-buffer-released": (ERROR, "a captured op's buffer was freed or reallocated while its CUDA graph lives"),
    "asymmetric-offset": (ERROR, "the same collective uses window buffers at different offsets or sizes on different ranks"),
    "free-in-flight": (ERROR, "a block was freed while an op not done for its stream uses it, without record_stream (the latent cause)"),
    "transient-in-window": (ERROR, "a block inside a symmetric window was freed without ever being a collective buffer"),
}
#: The rules that flag only a hazard's cause (a free, a placement), never an allocation or an access
#: that met in-flight work: the latent hazards of docs/hazard-model.md. They are errors all the same:
#: the collision they make possible depends on the shape, the hazard does not, and CI must fail on it
#: at the shapes where nothing collided. The proof's `steps_realised` leaves them out.
LATENT_ONLY = frozenset({"free-in-flight", "transient-in-window"})


def severity_of(rule: str) -> str:
    return RULES[rule][0]


class _ReadAsDict:
    """Records read as the JSON objects they render to: `rec["site"]`, `rec.get("window")`."""

    __slots__ = ()

    def to_dict(self) -> dict:
        raise NotImplementedError

    def get(self, key, default=None):
        return self.to_dict().get(key, default)

    def __getitem__(self, key):
        return self.to_dict()[key]

    def __contains__(self, key) -> bool:
        return key in self.to_dict()


@dataclass(frozen=True, slots=True)
class BlockRecord(_ReadAsDict):
    """The allocation a finding is about, as it was when the finding was made."""

    id: object
    addr: int
    size: int
    stream: object
    pool: object
    window: object  # communicator of the symmetric window it lies in
    window_offset: int | None
    site: str | None
    stack: list | None
    op: str | None
    line: int
    step: int | None

    @classmethod
    def of(cls, block) -> "BlockRecord":
        """From the engine's live block (the one place a block record is made)."""
        w = block.window
        return cls(id=block.id, addr=block.addr, size=block.end - block.addr, stream=block.stream,
                   pool=block.pool, window=w.comm if w is not None else None,
                   window_offset=block.addr - w.addr if w is not None else None, site=block.site,
                   stack=block.stack, op=block.op, line=block.line, step=block.step)

    def to_dict(self) -> dict:
        return {"id": self.id, "addr": self.addr, "size": self.size, "stream": self.stream,
                "pool": self.pool, "window": self.window, "window_offset": self.window_offset,
                "site": self.site, "stack": self.stack, "op": self.op, "line": self.line,
                "step": self.step}


@dataclass(frozen=True, slots=True)
class OpRecord(_ReadAsDict):
    """The device work a finding is about: a launch or a collective (`cid`, `comm`, `seq`);
    `replay_of_line` for a CUDA-graph replay; `rank`, `file` and `window_bufs` for the two sides
    of an asymmetric-offset."""

    kind: str
    op: str | None
    stream: object
    line: int
    step: int | None
    site: str | None
    stack: list | None
    cid: object = None
    comm: object = None
    seq: int | None = None
    replay_of_line: int | None = None
    rank: int | None = None
    file: str | None = None
    window_bufs: list | None = None

    @classmethod
    def of(cls, op, *, rank=None, file=None, window_sig=None) -> "OpRecord":
        """From the engine's op (the one place an op record is made). `window_sig`: the
        (window ordinal, offset, size) triples of its window buffers."""
        captured = op.captured
        return cls(kind=op.kind, op=op.name, stream=op.stream, line=op.line, step=op.step,
                   site=op.site, stack=op.stack, cid=op.cid, comm=op.comm, seq=op.seq,
                   replay_of_line=captured.line if captured is not None else None, rank=rank,
                   file=file,
                   window_bufs=None if window_sig is None else
                   [{"window": o, "offset": off, "size": size} for o, off, size in window_sig])

    def to_dict(self) -> dict:
        out = {"kind": self.kind, "op": self.op, "stream": self.stream, "line": self.line,
               "step": self.step, "site": self.site, "stack": self.stack}
        if self.kind == "coll":
            out.update(cid=self.cid, comm=self.comm, seq=self.seq)
        if self.replay_of_line is not None:
            out["replay_of_line"] = self.replay_of_line
        if self.rank is not None:
            out["rank"] = self.rank
        if self.file is not None:
            out["file"] = self.file
        if self.window_bufs is not None:
            out["window_bufs"] = self.window_bufs
        return out


@dataclass(slots=True)
class Finding:
    """One hazard. `line` is the trace line of the event that triggered it (header = line 1).

    `block` describes the allocation involved (addr, size, stream, pool, window offset, site,
    stack, op); `op` the in-flight work it collides with (kind, cid or op name, comm, seq,
    stream, site, line); `overlap` the colliding range [lo, hi).
    """

    rule: str
    severity: str
    rank: int
    step: int | None
    file: str
    line: int
    block: BlockRecord | OpRecord | None = None  # asymmetric-offset: this rank's collective
    op: OpRecord | None = None
    overlap: tuple[int, int] | None = None
    count: int = 1
    bytes: int = 0
    site: str | None = None
    detail: str | None = None
    by_step: dict = field(default_factory=dict)  # transient-in-window: blocks per decode step
    #: a sentence the check adds after the analysis: on a send still in flight to a rank of the
    #: check, that the order may come from a channel capture does not record (sanitizer.order.ranks)
    note: str | None = None

    def to_dict(self) -> dict:
        out = {
            "rule": self.rule,
            "severity": self.severity,
            "rank": self.rank,
            "step": self.step,
            "file": self.file,
            "line": self.line,
            "block": self.block.to_dict() if self.block is not None else None,
            "op": self.op.to_dict() if self.op is not None else None,
            "overlap": list(self.overlap) if self.overlap else None,
        }
        if self.rule == "transient-in-window":
            out["count"] = self.count
            out["bytes"] = self.bytes
            out["by_step"] = {str(k): v for k, v in self.by_step.items()}
        if self.site is not None:
            out["site"] = self.site
        if self.detail:
            out["detail"] = self.detail
        if self.note:
            out["note"] = self.note
        return out

    def headline_site(self) -> str | None:
        """Where it went wrong, as ASan leads: the bad access (`site`, for unordered-access), else
        the event's block (the allocation over the buffer, the freed block, the transient; for
        asymmetric-offset this rank's collective), else the op. Every format leads with it."""
        return self.site or (self.block or {}).get("site") or (self.op or {}).get("site")

    def group_key(self) -> tuple:
        """Findings that a reader wants to see once: same rule, same headline site, same op site."""
        return (self.rule, self.headline_site(), (self.op or {}).get("site"))


@dataclass
class FindingSink:
    """Collects findings; keeps at most `max_per_group` examples per group, counts all.

    A broken trace can produce millions of identical findings; the count stays exact while
    memory stays bounded. `max_per_group=0` keeps everything.
    """

    max_per_group: int = 100
    findings: list[Finding] = field(default_factory=list)
    by_rule: dict[str, int] = field(default_factory=dict)
    group_counts: dict[tuple, int] = field(default_factory=dict)
    omitted: int = 0
    #: callable(finding) -> bool: a finding it accepts is counted in `suppressed`, not reported
    #: (allowlist.Suppressions: `hazsan check --suppressions`)
    suppress: object = None
    suppressed: dict[str, int] = field(default_factory=dict)

    def add(self, finding: Finding) -> None:
        if self.suppress is not None and self.suppress(finding):
            self.suppressed[finding.rule] = self.suppressed.get(finding.rule, 0) + 1
            return
        self.by_rule[finding.rule] = self.by_rule.get(finding.rule, 0) + 1
        key = finding.group_key()
        n = self.group_counts.get(key, 0) + 1
        self.group_counts[key] = n
        if self.max_per_group and n > self.max_per_group:
            self.omitted += 1
            return
        self.findings.append(finding)
