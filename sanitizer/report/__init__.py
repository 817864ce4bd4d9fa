"""Renderings of an Analysis: text for people, JSON and SARIF for machines."""
from sanitizer.report.render import render

__all__ = ["render"]
