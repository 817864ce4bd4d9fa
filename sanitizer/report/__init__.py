"""Renderings of an Analysis: text for people, JSON and SARIF for machines (render.py), markdown
for CI summaries (markdown.py, built on render.py's pieces: the imports go one way)."""
from sanitizer.report.markdown import render_markdown
from sanitizer.report.render import render_json, render_sarif, render_text

__all__ = ["render"]

_BY_FORMAT = {"json": render_json, "sarif": render_sarif, "markdown": render_markdown}


def render(analysis, fmt: str = "text") -> str:
    return _BY_FORMAT.get(fmt, render_text)(analysis)
