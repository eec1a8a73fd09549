"""A rank other than 0: its stage loaded, it repeats rank 0's calls on step runners of its
own (`messages`), in the order they come, until rank 0 stops; the last rank sends each
forward's logits to rank 0."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from typing import Any

import torch

from offload.distributed.channel import Channel, PipelineError
from offload.distributed.cut import Link
from offload.distributed.join import Member
from offload.distributed.messages import Busy, Open, Ping, Ready, Stop

MakeRunner = Callable[[Open], Any]  # an `Open` -> the `StepRunner` it asks for


class StageWorker:
    """Rank `member.stage.rank`'s loop over rank 0's calls."""

    def __init__(self, member: Member, link: Link, make_runner: MakeRunner):
        self.member, self.link = member, link
        self._make_runner = make_runner
        self.runners: dict[int, Any] = {}
        self.busy_s = 0.0  # computing forwards (`Report`)

    def open(self, message: Open) -> None:
        self.runners[message.runner] = self._make_runner(message)

    def report(self) -> None:
        self.member.send(Busy(self.member.stage.rank, self.busy_s), 0)

    def run(self) -> None:
        """Until rank 0 says stop (or is gone: a `PipelineError`)."""
        self.member.send(Ready(self.member.stage.rank), 0)
        last = self.member.stage.is_last
        try:
            while True:
                message = self.member.recv(0)
                if isinstance(message, Stop):
                    return
                if isinstance(message, Ping):
                    continue
                start, waited = time.perf_counter(), self.link.waited_s
                with torch.inference_mode(), self.link.live():
                    result = message.apply(self)
                if message.forward:
                    waits = self.link.waited_s - waited
                    self.busy_s += time.perf_counter() - start - waits
                if message.forward and last:
                    for tensor in [result] if isinstance(result, torch.Tensor) else result:
                        self.member.channel.send_tensor(tensor, 0, Channel.LOGITS)
        finally:
            for runner in self.runners.values():
                runner.close()
            self.runners.clear()
            with contextlib.suppress(PipelineError):  # (the last logits, on their way)
                self.member.channel.flush()


def refuse(member: Member, error: BaseException) -> None:
    """Rank 0 told that this rank's stage could not be loaded, in one line."""
    line = str(error).strip().splitlines()[0][:300] if str(error).strip() else repr(error)
    with contextlib.suppress(PipelineError):  # (rank 0 is gone: nothing to tell)
        member.send(Ready(member.stage.rank, line), 0)
