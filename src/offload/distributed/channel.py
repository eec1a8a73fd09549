"""What the ranks of a pipeline send each other over torch.distributed's point-to-point
ops (gloo: CPU tensors; a GPU rank's go through host memory): tensors with a small header
(their dtype and shape), and the engine's calls as JSON (`messages`: no pickle, so a rank
runs no code it is sent). Each kind has its own tag, so a call and a hidden state from
one rank cannot be taken for each other. A peer that is gone or does not answer within
the group's timeout is one `PipelineError` naming its rank.

Sends are posted, not waited for (gloo's `send` returns only once the peer posts the
matching receive): a rank goes on to its next micro-batch while the next rank is busy
with the last one. Each posted send keeps its own copy of the tensor until it is done;
`reap` surfaces a failed one, `flush` waits for all."""

from __future__ import annotations

import contextlib
import os
import threading
from collections import deque
from collections.abc import Iterator

import torch
import torch.distributed as dist

from offload.errors import OffloadError

TIMEOUT_ENV = "OFFLOAD_PIPELINE_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 300.0  # the longest any rank waits for another (a slow stage's step)
_DTYPES = [
    torch.float32, torch.float16, torch.bfloat16, torch.float64,
    torch.int64, torch.int32, torch.uint8, torch.bool,
]  # fmt: skip
_HEADER = 8  # int64s: dtype, dims, then up to 6 sizes
_MAX_POSTED = 64  # sends posted and not done, at most: the oldest is waited for past this


class PipelineError(OffloadError):
    """A rank of the pipeline stopped, cannot be reached, or was left mid-step."""


def timeout_s() -> float:
    """The group's timeout: `OFFLOAD_PIPELINE_TIMEOUT_S`, else `DEFAULT_TIMEOUT_S`."""
    value = os.environ.get(TIMEOUT_ENV)
    try:
        seconds = float(value) if value else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise PipelineError(f"{TIMEOUT_ENV} must be a number of seconds > 0, got {value!r}")
    return seconds


class Channel:
    """Point-to-point sends and receives of this process's rank in the default group."""

    CALL, HIDDEN, LOGITS = 1, 2, 3  # tags

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self.sent_bytes = dict.fromkeys((self.CALL, self.HIDDEN, self.LOGITS), 0)  # by tag
        self.received_bytes = dict.fromkeys((self.CALL, self.HIDDEN, self.LOGITS), 0)
        self._posted: deque[tuple[object, torch.Tensor, int]] = deque()  # (work, data, peer)
        self._posting = threading.Lock()

    def send_tensor(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        """`tensor` posted to `peer` (a copy: the caller may reuse it at once)."""
        if tensor.dim() > _HEADER - 2:
            raise ValueError(f"a tensor of {tensor.dim()} dimensions is not sent")
        header = torch.zeros(_HEADER, dtype=torch.int64)
        header[0], header[1] = _DTYPES.index(tensor.dtype), tensor.dim()
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        data = tensor.detach()
        if data.device.type == "cpu":
            data = data.clone(memory_format=torch.contiguous_format)
        else:
            data = data.to("cpu").contiguous()
        with self._posting:
            # (in this order on the wire: one thread posts at a time)
            with self._talking(peer):
                for part in (header, data):
                    self._posted.append((dist.isend(part, peer, tag=tag), part, peer))
            self.sent_bytes[tag] += tensor.nbytes
        self.reap()

    def reap(self) -> None:
        """Sends done let go; a failed one's `PipelineError`. Past `_MAX_POSTED` posted,
        the oldest waited for (a peer far behind holds this rank back, not its memory)."""
        while True:
            with self._posting:
                if not self._posted:
                    return
                work, _, peer = self._posted[0]
                if not work.is_completed() and len(self._posted) <= _MAX_POSTED:
                    return
                self._posted.popleft()
            with self._talking(peer):
                work.wait()

    def flush(self) -> None:
        """Every posted send done (or its peer's error)."""
        while True:
            with self._posting:
                if not self._posted:
                    return
                work, _, peer = self._posted.popleft()
            with self._talking(peer):
                work.wait()

    def recv_tensor(self, peer: int, tag: int) -> torch.Tensor:
        header = torch.empty(_HEADER, dtype=torch.int64)
        with self._talking(peer):
            dist.recv(header, peer, tag=tag)
            dims = int(header[1])
            tensor = torch.empty(header[2 : 2 + dims].tolist(), dtype=_DTYPES[int(header[0])])
            dist.recv(tensor, peer, tag=tag)
        self.received_bytes[tag] += tensor.nbytes
        return tensor

    def send_bytes(self, payload: bytes, peer: int) -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        self.send_tensor(data, peer, self.CALL)

    def recv_bytes(self, peer: int) -> bytes:
        return self.recv_tensor(peer, self.CALL).numpy().tobytes()

    @contextlib.contextmanager
    def _talking(self, peer: int) -> Iterator[None]:
        try:
            yield
        except RuntimeError as error:  # (gloo's: a closed connection, a timeout)
            reason = str(error).strip().splitlines()[0] if str(error).strip() else "no reason"
            if "]" in reason:  # (gloo's source location first)
                reason = reason.split("]", 1)[1].strip()
            raise PipelineError(
                f"pipeline rank {peer} stopped or cannot be reached (rank {self.rank}: "
                f"{reason[:200]})"
            ) from None
