"""The six rules (DESIGN.md section 4) and the engine that applies them while streaming events."""
