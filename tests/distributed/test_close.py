"""Rank 0's close: each other rank's Stop is on the wire before the group is left. A
command ends at once after it (`process_exit`), closing its sockets: a Stop still posted
then never arrives, and a rank torchrun started finds its connection reset instead."""

from __future__ import annotations

from offload.distributed import pipeline as pipelined
from offload.distributed.join import Member
from offload.distributed.messages import Stop, decode
from offload.planner.stages import Stage


class _PostingChannel:
    """A channel whose sends are posted (gloo's `isend`) and written out by `flush`."""

    def __init__(self, size: int):
        self.size = size
        self.posted: list[tuple[int, bytes]] = []
        self.written: list[tuple[int, bytes]] = []

    def send_bytes(self, payload: bytes, peer: int) -> None:
        self.posted.append((peer, payload))

    def flush(self) -> None:
        self.written += self.posted
        self.posted.clear()


def test_every_stop_is_written_out_before_the_group_is_left(monkeypatch):
    channel = _PostingChannel(3)
    member = Member(channel, Stage(0, 3, range(2)))
    written_at_leave = []
    monkeypatch.setattr(
        pipelined, "leave", lambda m: written_at_leave.append(list(channel.written))
    )
    pipeline = pipelined.Pipeline(member, link=None)
    pipeline.close()
    [written] = written_at_leave
    assert sorted(peer for peer, _ in written) == [1, 2]
    assert all(isinstance(decode(payload), Stop) for _, payload in written)
    assert channel.posted == []
