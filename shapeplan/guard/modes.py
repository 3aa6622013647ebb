"""What a guarded run does with a shape its plan lacks (`--on-unplanned`, `ShapeGuard(on_unplanned=...)`)."""

MODES = ("warn", "error", "record")
