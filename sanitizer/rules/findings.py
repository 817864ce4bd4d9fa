"""Finding records and the rule table (DESIGN.md section 4)."""
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
    "free-in-flight": (WARNING, "a block was freed while an op not done for its stream uses it, without record_stream (the latent cause)"),
    "transient-in-window": (WARNING, "a block inside a symmetric window was freed without ever being a collective buffer"),
}


def severity_of(rule: str) -> str:
    return RULES[rule][0]


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
    block: dict | None = None
    op: dict | None = None
    overlap: tuple[int, int] | None = None
    count: int = 1
    bytes: int = 0
    site: str | None = None
    detail: str | None = None
    by_step: dict = field(default_factory=dict)  # transient-in-window: blocks per decode step

    def to_dict(self) -> dict:
        out = {
            "rule": self.rule,
            "severity": self.severity,
            "rank": self.rank,
            "step": self.step,
            "file": self.file,
            "line": self.line,
            "block": self.block,
            "op": self.op,
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
        return out

    def group_key(self) -> tuple:
        """Findings that a reader wants to see once: same rule, same two call sites."""
        block_site = (self.block or {}).get("site") or self.site
        op_site = (self.op or {}).get("site")
        return (self.rule, block_site, op_site)


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

    def add(self, finding: Finding) -> None:
        self.by_rule[finding.rule] = self.by_rule.get(finding.rule, 0) + 1
        key = finding.group_key()
        n = self.group_counts.get(key, 0) + 1
        self.group_counts[key] = n
        if self.max_per_group and n > self.max_per_group:
            self.omitted += 1
            return
        self.findings.append(finding)
