"""Joining a pipeline: the process group (gloo), the ranks started here where no launcher
started them, and the handshake that settles each rank's stage.

- Under `torchrun` (its `RANK`, `WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set), every
  rank runs the same command; rank 0 runs the engine, the others their stage.
- Else the process that makes the `LLM` is rank 0 and starts the others itself
  (`python -m offload.llm.pipeline_rank`, each handed the same arguments), with a store
  on loopback at a port the system picks.
Then each rank says which model it built (`Hello`), rank 0 answers with the split
(`Layout`: `planner.stages.split_layers` over the layers' bytes) and every rank loads its
stage.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from offload.distributed.channel import Channel, PipelineError, timeout_s
from offload.distributed.cut import stage_bytes
from offload.distributed.messages import Hello, Layout, Message, decode, encode
from offload.planner.stages import Stage, split_layers, steady

ARGS_ENV = "OFFLOAD_STAGE_ARGS"  # the file of `LLM` arguments a started rank reads
_JOINED = "offload/joined/"  # a started rank's key in rank 0's store


@dataclass
class Member:
    """This process's place in a pipeline."""

    channel: Channel
    stage: Stage
    children: list[subprocess.Popen] = field(default_factory=list)  # ranks started here
    places: list[str] = field(default_factory=list)  # where each rank computes (rank 0's)

    @property
    def apart(self) -> bool:
        """Whether no two ranks compute on the same host's CPUs or on the same GPU."""
        return len(set(self.places)) == self.channel.size

    def send(self, message: Message, peer: int) -> None:
        self.channel.send_bytes(encode(message), peer)

    def recv(self, peer: int) -> Message:
        return decode(self.channel.recv_bytes(peer))


def launched_rank(size: int) -> int | None:
    """This process's rank where a launcher (torchrun, or rank 0 here) started it, else
    None; a clear error where the launcher's world is not `size` ranks."""
    world = os.environ.get("WORLD_SIZE")
    if world is None or "RANK" not in os.environ:
        return None
    if world != str(size):
        raise PipelineError(
            f"the launcher started {world} processes but pipeline_parallel_size is {size}: "
            "they must be equal"
        )
    return int(os.environ["RANK"])


def place_of(device: torch.device) -> str:
    """Where a rank computes: its host, and its GPU or the host's CPUs."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        device = torch.device("cuda", index)
    return f"{socket.gethostname()} {device}"


def join(
    size: int,
    model: nn.Module,
    llm_kwargs: dict,
    module: str,
    room_bytes: int | None = None,
    place: str = "",
    rates: tuple[float | None, float | None] = (None, None),
) -> Member:
    """This process in a pipeline of `size` ranks over `model` (built, not loaded): the
    group joined (the other ranks started here where no launcher did: `python -m
    module`, given `llm_kwargs`), its stage settled (`room_bytes`: what this rank's budget
    holds in RAM, and `rates`, its RAM's and disk's GB/s, weighed by rank 0's split;
    `place`: where it computes, `place_of`)."""
    rank = launched_rank(size)
    split_layers(stage_bytes(model)[0], size)  # (a size the model cannot take: said first)
    if dist.is_initialized():  # (torch.distributed has one default group a process)
        raise PipelineError(
            "this process is in a pipeline already: close the other LLM with "
            "pipeline_parallel_size > 1 first"
        )
    children: list[subprocess.Popen] = []
    timeout = datetime.timedelta(seconds=timeout_s())
    try:
        if rank is None:
            rank, children = 0, _start_ranks(size, llm_kwargs, module, timeout)
        elif ARGS_ENV in os.environ:  # (started by rank 0 here: said at its store first)
            address, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
            store = dist.TCPStore(address, port, size, is_master=False, timeout=timeout)
            store.set(f"{_JOINED}{rank}", "1")
            dist.init_process_group(
                "gloo", store=store, rank=rank, world_size=size, timeout=timeout
            )
        else:
            dist.init_process_group(
                "gloo", init_method="env://", rank=rank, world_size=size, timeout=timeout
            )
    except (RuntimeError, ValueError, TimeoutError) as error:  # (a store not reached...)
        for child in children:
            child.kill()
        reason = str(error).strip().splitlines()[0] if str(error).strip() else "no reason"
        raise PipelineError(f"the pipeline's ranks could not meet: {reason[:200]}") from None
    member = Member(Channel(rank, size), Stage(rank, size, range(0)), children)
    try:
        member.stage = _settle(member, model, Hello(rank, "", 0, room_bytes, place, *rates))
    except BaseException:
        leave(member)
        raise
    return member


def _start_ranks(size: int, llm_kwargs: dict, module: str, timeout) -> list[subprocess.Popen]:
    """Ranks 1..size-1 started here, each `python -m module` given `llm_kwargs` (in a file
    only this user reads), meeting rank 0 (this process) at a store on loopback."""
    # Each rank computes with rank 0's threads (a product's bits may depend on how many
    # share it: so the ranks give one process's bits), and waits without spinning: ranks
    # take turns on one machine's cores, and a waiting rank's spinning threads slowed the
    # rank computing.
    threads = torch.get_num_threads()
    store = dist.TCPStore(
        "127.0.0.1", 0, size, is_master=True, timeout=timeout, wait_for_workers=False
    )
    folder = Path(tempfile.mkdtemp(prefix="offload-stage-"))  # (mode 0700)
    arguments = folder / "llm.pickle"
    arguments.write_bytes(pickle.dumps(llm_kwargs))
    children = []
    for rank in range(1, size):
        env = {
            **os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
            "RANK": str(rank), "WORLD_SIZE": str(size), ARGS_ENV: str(arguments),
            "OMP_NUM_THREADS": str(threads), "OMP_WAIT_POLICY": "PASSIVE",
        }  # fmt: skip
        # (a session of its own: Ctrl-C in a terminal reaches rank 0, which ends the rest)
        command = [sys.executable, "-m", module]
        children.append(subprocess.Popen(command, env=env, start_new_session=True))
    try:
        for rank, child in enumerate(children, start=1):
            _wait_joined(store, rank, child, timeout.total_seconds())
        dist.init_process_group("gloo", store=store, rank=0, world_size=size, timeout=timeout)
    except BaseException:
        for child in children:
            child.kill()
        raise
    finally:
        arguments.unlink(missing_ok=True)  # (read by every rank before it joins)
        folder.rmdir()
    return children


def _wait_joined(store, rank: int, child: subprocess.Popen, timeout_s: float) -> None:
    """Until rank `rank` (started here as `child`) said it is there; a clear error at
    once where it ended first (its own messages went to this process's stderr)."""
    waited = 0.0
    while not store.check([f"{_JOINED}{rank}"]):
        time.sleep(0.05)
        waited += 0.05
        if child.poll() is not None:
            raise PipelineError(
                f"pipeline rank {rank} ended before it joined (exit code {child.returncode})"
            )
        if waited >= timeout_s:
            raise PipelineError(f"pipeline rank {rank} did not join within {timeout_s:.0f} s")


def _settle(member: Member, model: nn.Module, mine: Hello) -> Stage:
    """Each rank's layers: rank 0 checks every rank built its model and sends the split,
    weighing each rank's room and rates (`mine`: this rank's; rank 0 keeps where each
    computes)."""
    size = member.channel.size
    layer_bytes, first, last = stage_bytes(model)
    name = type(model).__name__
    if member.stage.rank != 0:
        member.send(dataclasses.replace(mine, model=name, num_layers=len(layer_bytes)), 0)
        layout = member.recv(0)
        if not isinstance(layout, Layout):
            raise PipelineError(f"rank 0 sent {type(layout).__name__} before the layout")
        start, end = layout.stages[member.stage.rank]
        return Stage(member.stage.rank, size, range(start, end))
    hellos = [mine]
    for rank in range(1, size):
        hello = member.recv(rank)
        if not isinstance(hello, Hello) or (hello.model, hello.num_layers) != (
            name,
            len(layer_bytes),
        ):
            seen = (
                f"{hello.model} of {hello.num_layers} layers" if isinstance(hello, Hello) else hello
            )
            raise PipelineError(
                f"pipeline rank {rank} built {seen}, rank 0 {name} of {len(layer_bytes)} "
                "layers: every rank must load the same model"
            )
        hellos.append(hello)
    member.places = [hello.place for hello in hellos]
    rooms = [hello.room_bytes for hello in hellos]
    rates = steady(_per_host(hellos, [hello.ram_gb_per_s for hello in hellos]))
    if not all(rates):  # (a rank that did not measure: equal rates, an assumed disk)
        rates, disks = None, None
    else:
        disks = steady(_per_host(hellos, [hello.disk_gb_per_s for hello in hellos]))
    stages = split_layers(layer_bytes, size, first, last, rates, rooms, disks)
    for rank in range(1, size):
        member.send(Layout([[s.start, s.stop] for s in stages]), rank)
    return Stage(0, size, stages[0])


def _per_host(hellos: list[Hello], rates: list[float | None]) -> list[float | None]:
    """Each rank's rate, the median of its host's ranks' (ranks on one host read the same
    memory and disk: their probes differ by the load of the moment, not the machine)."""
    hosts: dict[str, list[float]] = {}
    for hello, rate in zip(hellos, rates, strict=True):
        if rate:
            hosts.setdefault(hello.place.rsplit(" ", 1)[0], []).append(rate)
    medians = {host: statistics.median(values) for host, values in hosts.items()}
    return [
        medians.get(hello.place.rsplit(" ", 1)[0]) if rate else rate
        for hello, rate in zip(hellos, rates, strict=True)
    ]


def leave(member: Member, wait_s: float = 10.0) -> None:
    """The group left; ranks started here waited for (then ended)."""
    for child in member.children:
        try:
            child.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    if dist.is_initialized():
        dist.destroy_process_group()


def first_dead(member: Member) -> int | None:
    """The rank started here that ended first by a signal or an error, if any."""
    for rank, child in enumerate(member.children, start=1):
        if child.poll() is not None and child.returncode != 0:
            return rank
    return None
