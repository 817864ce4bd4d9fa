"""Happens-before ordering per rank (docs/ordering-and-rules.md, "Vector clocks")."""
