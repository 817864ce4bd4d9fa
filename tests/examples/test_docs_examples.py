"""Every trace example in docs/ is run through `hazsan check` and must give what the page says.

An example is a fenced ```jsonl block; each line starting with {"hazsan": ...} starts a new rank
file. The paragraph after it starts with "Checked:" and holds one or more statements

    `hazsan check [OPTIONS]` exits N with `rule` at line L and `rule` on rank R at line L,
        warning "text", malformed line L "text" ... / with no findings

which are asserted exactly: the exit code, the multiset of (rule, rank, line) findings, the set of
malformed lines (each message containing its text) and each warning's text.

Examples of decisions that the engine does not implement yet are listed in PENDING and run as
strict xfails: once the engine lands, the xfail turns into a failure that says to drop the entry.
"""
from __future__ import annotations

import json
import re
import shlex
from collections import Counter
from pathlib import Path

import pytest

from sanitizer.cli import main
from sanitizer.rules.findings import RULES

DOCS = Path(__file__).resolve().parents[2] / "docs"

# (page, a string unique to the example) -> why it does not pass yet.
PENDING: dict = {}

_FENCE = re.compile(r"^```jsonl[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_STATEMENT = re.compile(r"`hazsan check([^`]*)` exits (\d)(.*?)(?=`hazsan check|\Z)", re.S)
_FINDING = re.compile(r"`([a-z]+(?:-[a-z]+)+)`(?: on rank (\d+))? at line (\d+)")
_MALFORMED = re.compile(r'malformed line (\d+) "([^"]+)"')
_WARNING = re.compile(r'warning "([^"]+)"')


def _examples():
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text(encoding="utf-8")
        for m in _FENCE.finditer(text):
            line_no = text.count("\n", 0, m.start()) + 1
            rest = text[m.end():].lstrip("\n")
            paragraph = rest.split("\n\n", 1)[0]
            yield pytest.param(page.name, m.group(1), paragraph, id=f"{page.name}:{line_no}")


EXAMPLES = list(_examples())


def _files(block: str, tmp_path: Path) -> list[Path]:
    ranks: list[list[str]] = []
    for line in block.splitlines():
        if not line.strip():
            continue
        obj = json.loads(line)  # every example line must be JSON (docs show no broken lines)
        if "hazsan" in obj:
            ranks.append([])
        assert ranks, "an example must start with a header line"
        ranks[-1].append(line)
    paths = []
    for i, lines in enumerate(ranks):
        path = tmp_path / (f"rank{i}.jsonl" if len(ranks) > 1 else "example.jsonl")
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        paths.append(path)
    return paths


def _statements(paragraph: str):
    assert paragraph.startswith("Checked:"), f"an example must be followed by a 'Checked:' line, got {paragraph[:80]!r}"
    found = list(_STATEMENT.finditer(paragraph))
    assert found, f"no `hazsan check ...` exits N statement in {paragraph!r}"
    for m in found:
        options, code, claims = shlex.split(m.group(1)), int(m.group(2)), m.group(3)
        findings = Counter((rule, int(rank) if rank else None, int(line))
                           for rule, rank, line in _FINDING.findall(claims) if rule in RULES)
        malformed = {int(line): text for line, text in _MALFORMED.findall(claims)}
        warnings = _WARNING.findall(claims)
        assert findings or malformed or "no findings" in claims, \
            f"state the findings (or 'no findings') in {m.group(0)!r}"
        yield options, code, findings, malformed, warnings


def _check(paths, options, capsys):
    code = main(["check", *map(str, paths), *options, "--format", "json"])
    out = capsys.readouterr().out
    return code, json.loads(out)


def test_the_docs_hold_examples():
    pages = Counter(p.values[0] for p in EXAMPLES)
    assert pages["trace-format.md"] >= 4 and pages["ordering-and-rules.md"] >= 10, pages
    stated = {rule for p in EXAMPLES for rule, _, _ in _FINDING.findall(p.values[2])}
    assert set(RULES) <= stated, f"rules without a checked example: {set(RULES) - stated}"


@pytest.mark.parametrize("page,block,paragraph", EXAMPLES)
def test_example_gives_the_stated_result(page, block, paragraph, tmp_path, capsys, request):
    why = next((w for (p, key), w in PENDING.items() if p == page and key in block), None)
    if why:
        request.applymarker(pytest.mark.xfail(reason=f"pending: {why}; drop it from PENDING once it passes",
                                              strict=True))
    paths = _files(block, tmp_path)
    single_rank = len(paths) == 1
    for options, code, findings, malformed, warnings in _statements(paragraph):
        got_code, doc = _check(paths, options, capsys)
        got = Counter((f["rule"], None if single_rank else f["rank"], f["line"]) for f in doc["findings"])
        errors = {}
        for e in doc["summary"]["errors"]:
            m = re.match(r"(.*?):(\d+): (.*)", e)
            assert m, e
            errors[int(m.group(2))] = m.group(3)
        assert got_code == code, (options, got_code, doc["findings"], doc["summary"]["errors"])
        assert got == findings, options
        assert set(errors) == set(malformed), errors
        for line, text in malformed.items():
            assert text in errors[line], (line, errors[line])
        for text in warnings:
            assert any(text in w for w in doc["summary"]["warnings"]), (text, doc["summary"]["warnings"])


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_pages_resolve():
    """Every relative link in docs/ (and README.md's links into docs/) names a page and heading that exist."""
    root = DOCS.parent
    anchors = {}
    for page in [*DOCS.glob("*.md"), root / "README.md"]:
        text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
        anchors[page.resolve()] = {_slug(h) for h in re.findall(r"^#+ (.*)$", text, re.M)}
    broken = []
    for page in anchors:
        text = re.sub(r"`[^`\n]*`", "", page.read_text(encoding="utf-8"))   # code spans hold no links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if path.endswith("/"):
                dest = dest / "README.md"
            if dest.is_dir():
                continue
            if not dest.exists() or (anchor and anchor not in anchors.get(dest, ())):
                broken.append(f"{page.name}: {target}")
    assert broken == []
