"""The engine core's forwards as they run, for tests of its schedule."""

from offload.engine.step_runner import StepRunner


def record_forwards(monkeypatch) -> list[tuple]:
    """Records each forward of every `StepRunner`: ("prefill", columns), ("decode", rows),
    ("mixed", rows, columns) for a decode step that carried a prompt's chunk, and
    ("apart",) where one could not run then (its two forwards then recorded apart)."""
    events = []
    prefill_of, mixed_of, decode_of = StepRunner.prefill, StepRunner.mixed, StepRunner.decode

    def prefill(self, group, start, end):
        events.append(("prefill", end - start))
        return prefill_of(self, group, start, end)

    def mixed(self, rows, group, start, end):
        both = mixed_of(self, rows, group, start, end)
        events.append(("mixed", len(rows), end - start) if both is not None else ("apart",))
        return both

    def decode(self, rows):
        events.append(("decode", len(rows)))
        return decode_of(self, rows)

    for name, spy in (("prefill", prefill), ("mixed", mixed), ("decode", decode)):
        monkeypatch.setattr(StepRunner, name, spy)
    return events
