"""The engine core's forwards as they run, for tests of its schedule."""

from offload.engine.step_runner import StepRunner


def record_forwards(monkeypatch) -> list[tuple]:
    """Records each forward of every `StepRunner`: ("prefill", columns), ("decode", rows),
    ("mixed", rows, columns...) for a decode step that carried prompts' chunks (each one's
    columns), and ("apart",) where one could not run then (its forwards then recorded
    apart)."""
    events = []
    prefill_of, mixed_of, decode_of = StepRunner.prefill, StepRunner.packed, StepRunner.decode

    def prefill(self, group, start, end):
        events.append(("prefill", end - start))
        return prefill_of(self, group, start, end)

    def mixed(self, rows, chunks):
        both = mixed_of(self, rows, chunks)
        columns = [end - start for _, start, end in chunks]
        events.append(("mixed", len(rows), *columns) if both is not None else ("apart",))
        return both

    def decode(self, rows):
        events.append(("decode", len(rows)))
        return decode_of(self, rows)

    for name, spy in (("prefill", prefill), ("packed", mixed), ("decode", decode)):
        monkeypatch.setattr(StepRunner, name, spy)
    return events
