"""The trace contract (DESIGN.md section 2): event kinds, fields, and the streaming reader."""
