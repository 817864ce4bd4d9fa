"""The trace contract (docs/trace-format.md): event kinds, fields, and the streaming reader."""
