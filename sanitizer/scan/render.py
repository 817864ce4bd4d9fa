"""Text (for people), JSON (for tools) and Markdown (for reports) renderings of a ScanResult."""
from __future__ import annotations

import orjson

from sanitizer.scan.scanner import ScanResult, ScopeReport

CLASS_ORDER = ("compute", "copy", "alloc")
CLASS_MEANING = {
    "compute": "runs ops or unknown code inside the window: transients may land there",
    "copy": "one copy or cast that becomes a collective's input",
    "alloc": "only output allocations, and kernels that write into tensors given to them",
}
PRIVATE_MEANING = ("use_mem_pool on a pool that is no symmetric window (KV cache, graph pool, ...): "
                   "an allocation there is no hazard by itself; listed, never failing")
MAX_PATHS_SHOWN = 4


def _groups(result: ScanResult):
    """(title, meaning, scopes): the window scopes by class, then the private-pool scopes."""
    for klass in CLASS_ORDER:
        group = [s for s in result.scopes if s.window and s.klass == klass]
        if group:
            yield klass, CLASS_MEANING[klass], group
    private = [s for s in result.scopes if not s.window]
    if private:
        yield "private pools", PRIVATE_MEANING, private


def _path_lines(s: ScopeReport) -> list[str]:
    """The conditions on each way to the scope (only the ways that hold any)."""
    out = []
    shown = [p for p in s.paths if p.conditions or p.via]
    for p in shown[:MAX_PATHS_SHOWN]:
        conds = "; ".join(c.text for c in p.conditions) or "no condition"
        via = f"  <- {' <- '.join(p.via)}" if p.via else ""
        out.append(f"{conds}{via}")
    if len(shown) > MAX_PATHS_SHOWN:
        out.append(f"... {len(shown) - MAX_PATHS_SHOWN} more way(s)")
    return out


def _marks(s: ScopeReport) -> list[str]:
    marks = []
    if s.window and s.klass == "compute" and s.fallback_only:
        marks.append("fallback-only")
    if s.when and s.when["only_under"]:
        marks.append("only under " + ", ".join(s.when["only_under"]))
    if s.when and s.when["class_before"] != s.klass:
        marks.append(f"{s.klass} under {' '.join(s.when['conditions'])} "
                     f"({s.when['class_before']} through calls that run on other hardware only)")
    if s.changed:
        marks.append("changed: " + ", ".join(s.changed[:4]))
    return marks


def _recognised(s: ScopeReport) -> str:
    """How the scan knows this is a scope in a window (or in a private pool), with the chain."""
    rec = s.recognised or {}
    how = rec.get("how")
    if how == "name":
        return f"by name ({rec.get('name')})"
    chain = " -> ".join(rec.get("chain", []))
    return f"{how}: {chain}" if how else "-"


def render_json(result: ScanResult) -> str:
    return orjson.dumps(result.as_dict(), option=orjson.OPT_INDENT_2).decode() + "\n"


def _call_lines(records, indent: str, limit: int = 12) -> list[str]:
    out: list[str] = []

    def walk(recs, pad, budget):
        for r in recs:
            if len(out) >= budget:
                out.append(f"{pad}...")
                return
            mark = "!" if r.transient else " "
            where = f"{r.file}:{r.line}"
            helper = f" -> {r.helper}" if r.helper else ""
            out.append(f"{pad}{mark} {r.kind:7} {r.callee}  [{where}] {r.reason}{helper}")
            walk(_telling(r.inner), pad + "    ", budget)

    walk(records, indent, limit)
    return out


def _weight(r) -> int:
    """How well a record explains a class, lower is better: a resolved op or kernel launch,
    a transient, a helper whose body holds one of those, then unresolved guesses."""
    if r.kind == "compute" and r.resolved and not r.helper:
        return 0
    if r.transient and r.kind != "compute":
        return 1
    if r.inner:
        return min(_weight(i) for i in r.inner) + (0 if r.resolved else 1)
    return 4


def _telling(records, limit: int = 4):
    """The records worth showing: the most explanatory first, then in line order."""
    interesting = [i for i in records if i.kind == "compute" or i.transient] or list(records)
    return sorted(interesting, key=lambda r: (_weight(r), r.line))[:limit]


def _status(s: ScopeReport) -> str:
    if s.disabled:
        return "statically disabled"
    if s.allowed is not None:
        return f"allowed ({s.allowed.source}: {s.allowed.reason})"
    return "NOT ALLOWED" if s.failing else ""


def _runtime_line(s: ScopeReport) -> str | None:
    rt = s.runtime
    if rt is None:
        return None
    if rt["transients"]:
        return (f"runtime: {rt['transients']} transient(s) placed in a window, {rt['bytes']} bytes "
                f"(sites: {', '.join(rt['sites'][:4])})")
    if rt["entered"]:
        return f"runtime: entered {rt['entered']} time(s) with a site; no transient placed in a window"
    return None


def render_text(result: ScanResult) -> str:
    lines: list[str] = []
    summ = result.summary()
    bc = summ["by_class"]
    lines.append(f"hazsan scan: {summ['scopes']} scope(s) in {summ['files']} file(s) "
                 f"({summ['files_parsed']} parsed): {summ['window_scopes']} in symmetric windows "
                 f"({bc['compute']} compute, {summ['compute_unresolved']} of them unresolved, {bc['copy']} copy, "
                 f"{bc['alloc']} alloc), {summ['private_pool_scopes']} in private pools; "
                 f"{summ['failing']} compute scope(s) not allowed; {summ['fallback_only_compute']} "
                 f"compute scope(s) fallback-only")
    filters = _filter_line(result)
    if filters:
        lines.append(filters)
    for title, meaning, group in _groups(result):
        lines.append("")
        lines.append(f"== {title} ({len(group)}): {meaning}")
        for s in group:
            lines.append("")
            status = _status(s)
            label = f"  {s.label}" if title == "private pools" or s.unresolved else ""
            lines.append(f"{s.file}:{s.line}  in {s.function}  [{s.scope} via {s.entered}"
                         f"{' / ' + ' / '.join(s.via) if s.via else ''}]{label}"
                         + (f"  {status}" if status else ""))
            lines.append(f"  recognised: {_recognised(s)}")
            for mark in _marks(s):
                lines.append(f"  {mark}")
            if s.guard:
                lines.append(f"  guard: {s.guard}")
            for path in _path_lines(s):
                lines.append(f"  reached: {path}")
            if s.pool:
                lines.append(f"  pool: {s.pool}")
            if s.parent:
                lines.append(f"  nested in the scope at line {s.parent}")
            if s.yields:
                lines.append("  body yields: the callers' with-blocks are reported as scopes entered through this helper")
            if s.nested:
                lines.append(f"  holds nested scope(s) at line(s) {', '.join(map(str, s.nested))}, reported separately")
            rt = _runtime_line(s)
            if rt:
                lines.append(f"  {rt}")
            if s.klass != "alloc":
                for no, text in s.snippet:
                    lines.append(f"  {no:6} | {text}")
                if s.end_line > s.snippet[-1][0] if s.snippet else False:
                    lines.append(f"  {'':6} | ... (to line {s.end_line})")
            lines += _call_lines(s.records, "  ")
    if result.problems:
        lines.append("")
        lines.append(f"== files not scanned ({len(result.problems)})")
        for p in result.problems:
            lines.append(f"{p.file}:{p.line or '-'}: {p.message}")
    if result.allow_unused:
        lines.append("")
        lines.append("== allow-list entries that matched nothing")
        for e in result.allow_unused:
            lines.append(f"{e.source}: {e.pattern}")
    if result.runtime is not None:
        rt = result.runtime
        lines.append("")
        lines.append(f"== runtime ({rt['files']} trace file(s)): {rt['transients']} transient(s) in a window, "
                     f"{rt['attributed']} attributed to a scope, {rt['unattributed']} not")
        for site in rt.get("unattributed_sites", [])[:10]:
            lines.append(f"  unattributed: {site}")
        for w in rt.get("warnings", [])[:10]:
            lines.append(f"  warning: {w}")
    failing = result.failing
    lines.append("")
    if failing:
        lines.append(f"FAIL: {len(failing)} compute scope(s) not on the allow-list: "
                     + ", ".join(f"{s.file}:{s.line}" for s in failing[:8])
                     + (f", +{len(failing) - 8} more" if len(failing) > 8 else ""))
    else:
        lines.append("OK: no compute scope outside the allow-list")
    return "\n".join(lines) + "\n"


def _filter_line(result: ScanResult) -> str | None:
    parts = []
    if result.when:
        n = result.filtered.get("when", 0)
        parts.append(f"--when {' '.join(result.when)}: {n} scope(s) not reachable left out")
    if "changed_since" in result.filtered:
        parts.append(f"--changed-since: {result.filtered['changed_since']} unchanged scope(s) left out")
    return "; ".join(parts) or None


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def render_markdown(result: ScanResult, title: str = "hazsan scan") -> str:
    summ = result.summary()
    bc = summ["by_class"]
    out = [f"# {title}", ""]
    if result.command:
        out += [f"Regenerate with: `{result.command}`", ""]
    out += [f"{summ['scopes']} scopes in {summ['files']} files ({summ['files_parsed']} parsed, "
            f"helpers followed to depth {summ['depth']}). {summ['window_scopes']} allocate into a "
            f"symmetric window: **{bc['compute']} compute** ({summ['compute_unresolved']} of them "
            f"unresolved), {bc['copy']} copy, {bc['alloc']} alloc. {summ['private_pool_scopes']} are in "
            f"private pools (never failing). {summ['failing']} compute scopes are not on the allow-list; "
            f"{summ['allowed']} are; {summ['statically_disabled']} are statically disabled; "
            f"{summ['fallback_only_compute']} compute scopes are fallback-only. "
            f"Files not scanned: {len(result.problems)}.", ""]
    filters = _filter_line(result)
    if filters:
        out += [filters, ""]
    out += ["| class | meaning |", "|---|---|"]
    out += [f"| {k} | {CLASS_MEANING[k]} |" for k in CLASS_ORDER]
    out += ["| compute (unresolved) | compute only through calls the scan cannot see into "
            "(compiled extensions, objects of unknown type); settle them with `call:` allow-list entries |"]
    out += [f"| private pools | {PRIVATE_MEANING} |", ""]
    for title, _meaning, group in _groups(result):
        out += [f"## {title} ({len(group)})", ""]
        out += ["| scope | function | class | pool | entered | recognised | conditions on the way | most telling calls | status |",
                "|---|---|---|---|---|---|---|---|---|"]
        for s in group:
            calls = [r for r in s.records if r.kind == "compute" or r.transient]
            if s.klass == "alloc":
                calls = s.kernels
            shown = "; ".join(_md_escape(_chain(r)) for r in _telling(calls, 3))
            if len(calls) > 3:
                shown += f"; +{len(calls) - 3} more"
            pool = "symmetric" if s.symmetric else (f"`{_md_escape(s.pool)}`" if s.pool else "")
            entered = s.entered + (" / " + " / ".join(s.via) if s.via else "")
            conds = "<br>".join(_md_escape(p) for p in _path_lines(s))
            status = "; ".join([_status(s)] + _marks(s)).strip("; ")
            out.append(f"| `{s.file}:{s.line}` | `{_md_escape(s.function)}` | {s.label} | {pool} | "
                       f"{_md_escape(entered)} | {_md_escape(_recognised(s))} | {conds} | {shown} | "
                       f"{_md_escape(status)} |")
        out.append("")
    compute = [s for s in result.scopes if s.window and s.klass == "compute"]
    if compute:
        out += ["## compute scopes in detail", ""]
        for s in compute:
            out += [f"### `{s.file}:{s.line}` ({_md_escape(s.function)}, {s.label})", ""]
            rt = _runtime_line(s)
            if rt:
                out += [f"*{rt}*", ""]
            out += ["```python"] + [f"{no:6} | {text}" for no, text in s.snippet] + ["```", ""]
            out += ["```"] + _call_lines(s.records, "") + ["```", ""]
    if result.problems:
        out += ["## Files not scanned", ""]
        out += [f"- `{p.file}:{p.line or '-'}`: {_md_escape(p.message)}" for p in result.problems]
        out.append("")
    return "\n".join(out)


def _chain(r) -> str:
    text = f"{r.callee} ({r.reason})"
    inner = _telling(r.inner, 1)
    if inner:
        text += " -> " + _chain(inner[0])
    return text
