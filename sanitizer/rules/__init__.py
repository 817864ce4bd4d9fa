"""The six rules (docs/ordering-and-rules.md, "The rules") and the engine that applies them while streaming events."""
