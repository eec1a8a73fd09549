"""The prefetch backend's wait and start steps as `torch.library` custom ops.

Under torch.compile a layer's body is traced into the same graph as the steps around
it, and only data dependencies keep them in order (inductor does move independent work:
with only the first input declared, a two-stream block's second stream was computed after
later layers had refilled its slot). Both ops declare the layer's streams as mutated:
`wait_layer` mutates its input streams (the first floating-point input and the others of
a width its weights take, see `hooks._streams`), so everything the layer computes from
them comes after the wait (and after the previous layer, which produced them);
`start_layer` mutates every floating-point output, so it comes after every computation
that feeds them and before the next layer reads any of them. Neither touches the data.
The weights are passed as read-only arguments: they are the tensors that the wait
makes valid, and passing them lets the op check that the compiled graph hands it the
slot's own storage, not a copy. Registered once, at import (the only import-time effect).

Why the weights are not declared mutated too (which would order weight-only compute after
the wait): measured with torch 2.13, the weights become mutated graph inputs that alias
each other (views of one slot), AOT autograd merges them into synthetic bases, and its
compile cache then serves a graph built for one slot layout to another (prefetch_step 2
then 3 on the same model, in two processes): the op receives copies and raises. Without
inductor (aot_eager), the mutation clones every weight and writes it back at graph end.
"""

from __future__ import annotations

import gc
import itertools
import threading
import weakref
from typing import Protocol

import torch
from torch import Tensor


class _Steps(Protocol):
    def check_compiled(self, position: int, weights: list[Tensor]) -> None: ...

    def wait(self, position: int) -> None: ...

    def layer_done(self, position: int, *, compiled: bool = False) -> None: ...


_offloaders: weakref.WeakValueDictionary[int, _Steps] = weakref.WeakValueDictionary()
_registering = threading.Lock()


def register(offloader: _Steps) -> int:
    """An id that the ops use to find `offloader` (several may live side by side): the
    smallest no live offloader holds. A compiled graph holds it as a constant, so a
    process's first offloader has the same id in every process, and a compiled step kept
    on disk by one is found by the next (`engine/step_cache` names it by the id). An id is
    free again only once its offloader is gone, and with it the hooks that name it (they
    hold it alive through its state-dict hooks)."""
    with _registering:
        key = next(key for key in itertools.count() if key not in _offloaders)
        _offloaders[key] = offloader
    return key


def free_dropped() -> None:
    """The ids held by offloaders of models dropped but not yet collected (a model holds
    reference cycles, so it lives until Python's next full collection) freed, by collecting
    now where any id is held. Called once a model, before its offloaders register: a model
    made after another was dropped then takes the id the dropped one held, and loads its
    step kept on disk instead of compiling the step again (the id is a constant of the
    graph and names its file)."""
    if len(_offloaders):  # (outside the lock: a collected offloader's finalizer unregisters)
        gc.collect()


def unregister(offloader_id: int) -> None:
    """Free `offloader_id` now (an offloader made per call frees its id when it closes, so
    that the next call's gets the same one and a compiled graph that holds it still
    matches)."""
    with _registering:
        _offloaders.pop(offloader_id, None)


# Defined with `torch.library.Library`, not `torch.library.custom_op`: the latter's Python
# autograd and in-place-or-view kernels cost several times as much a call, 60 calls a step
# of the default model, a share of its compiled CPU step (docs/benchmarks.md). Neither op
# touches data, and both run under torch.no_grad, so they need neither kernel.
_library = torch.library.Library("offload", "FRAGMENT")
_SCHEMA = "(Tensor(a!)[] activations, Tensor[] weights, int offloader_id, int position) -> ()"


def define_op(name: str, schema: str, kernel, fake):
    """`offload::<name>` with `schema` ("(Tensor x, ...) -> Tensor"): `kernel` on every
    device, `fake` for tracing. The way the ops above are made (cheaper a call than
    `custom_op`'s, see above), for the operations a compiled step keeps opaque; like them, no
    autograd formula: they run under torch.no_grad. Returns the op."""
    _library.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
    _library.impl(name, kernel, "CompositeExplicitAutograd")
    torch.library.register_fake(f"offload::{name}", fake, lib=_library)
    return getattr(torch.ops.offload, name).default


def offloader(offloader_id: int) -> _Steps:
    """The offloader registered under `offloader_id`."""
    return _offloaders[offloader_id]


NO_OFFLOADER = -1  # the id of a layer boundary without an offloader: both ops do nothing


def wait_layer(
    activations: list[Tensor], weights: list[Tensor], offloader_id: int, position: int
) -> None:
    if offloader_id == NO_OFFLOADER:
        return
    offloader = _offloaders[offloader_id]
    offloader.check_compiled(position, weights)
    offloader.wait(position)


def start_layer(
    activations: list[Tensor], weights: list[Tensor], offloader_id: int, position: int
) -> None:
    if offloader_id != NO_OFFLOADER:
        _offloaders[offloader_id].layer_done(position, compiled=True)


def _nothing(
    activations: list[Tensor], weights: list[Tensor], offloader_id: int, position: int
) -> None:
    return None


for _step in (wait_layer, start_layer):
    define_op(_step.__name__, _SCHEMA, _step, _nothing)
