"""Happens-before ordering per rank (DESIGN.md section 3)."""
