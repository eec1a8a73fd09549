"""A chat answer's tool calls streamed: its content while no call has begun, then each
call once it is complete, as `ToolPlan.message` would read the whole answer."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from offload.server.tool_parsers import ToolCall

if TYPE_CHECKING:
    from offload.server.tools import ToolPlan


class ToolStream:
    """One streamed choice's deltas: its content while no call has begun, then each call
    in one delta once it is complete (its index, id, name and all of its arguments; vLLM
    sends the arguments in pieces, which a client joins into the same text). A named
    call's arguments are the text itself, sent as it comes, as vLLM does. Where a call
    that does not parse follows calls already sent, the stream keeps those and drops the
    rest, though the whole answer would be all content (vLLM's streams cannot take back
    what they sent either)."""

    def __init__(self, plan: ToolPlan):
        self._plan = plan
        self._sent = 0  # characters of the text sent (as content, or a named call's arguments)
        self._calls: list[ToolCall] = []  # the calls sent

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def delta(self, text: str, finished: bool) -> dict[str, Any]:
        """What of `text` (all of the answer so far) goes out now."""
        if self._plan.choice == "named":
            return self._named(text, finished)
        end, calls = self._plan.parser.partial(text)
        if finished:  # (the whole answer, read as `ToolPlan.message` reads it)
            parsed = self._plan.parser.parse(text)
            if parsed.calls:
                calls = list(parsed.calls)
            elif not self._calls:
                end, calls = len(text), []
        if not self._plan.parallel:
            calls = calls[:1]
        delta: dict[str, Any] = {}
        if end > self._sent:
            delta["content"] = text[self._sent : end]
            self._sent = end
        new = calls[len(self._calls) :]
        if new:
            start = len(self._calls)
            delta["tool_calls"] = [
                {"index": start + number, **call.body()} for number, call in enumerate(new)
            ]
            self._calls += new
        return delta

    def _named(self, text: str, finished: bool) -> dict[str, Any]:
        piece = text[self._sent :]
        self._sent = len(text)
        if not piece and (self._calls or not finished):
            return {}
        if self._calls:
            return {"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}
        call = ToolCall(self._plan.function, piece)
        self._calls.append(call)
        return {"tool_calls": [{"index": 0, **call.body()}]}
