"""Module units: catch weights that are read outside their own module's forward.

With `prefetch_unit="module"` each weight module is waited for in its own pre-forward.
Some layers read a child's weights directly instead of calling the child (Mamba's mixer
reads `dt_proj.weight` and `conv1d.weight`); such a read would see whatever its slot
holds. The first calls of each offloaded layer therefore run under a torch-function mode
that sees every use of its units' weights: a use that is not inside the unit's forward
is made safe on the spot (the unit is loaded if its slot holds another, and waited
for), and that layer keeps the check for good (slower, but exact), with one warning.
The check runs only eagerly: a compiled model refuses (ModelError) to run a layer that
has not passed it (Mamba under torch.compile with module units was silently wrong).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

# Calls that look at a tensor's metadata, never at its bytes.
_METADATA = {
    torch.Tensor.data_ptr,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.element_size,
    torch.Tensor.stride,
    torch.Tensor.storage_offset,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    torch.Tensor.get_device,
    torch.Tensor.untyped_storage,
    torch.Tensor.__hash__,
    *(
        getattr(torch.Tensor, name).__get__
        for name in ("shape", "dtype", "device", "ndim", "requires_grad", "is_cuda", "layout")
    ),
}

_MODULE_UNITS = "module units (prefetch_unit 'module', or 'auto' on a CPU)"

# Calls of an offloaded layer that run under the check before it is trusted: the prefill
# and the first decode step of a generate take different code paths in some layers.
NUM_CHECKED_CALLS = 2


class _UnitReads(TorchFunctionMode):
    def __init__(self, check: UnitReadCheck):
        super().__init__()
        self._check = check

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # A mode left on this thread's stack by an interrupted forward checks nothing.
        if func not in _METADATA and self._check.active_mode is self:
            for value in (*args, *kwargs.values()):
                for tensor in value if isinstance(value, list | tuple) else (value,):
                    position = self._check.positions.get(id(tensor))
                    if position is not None:
                        self._check.ensure_loaded(position)
        return func(*args, **kwargs)


class UnitReadCheck:
    """Attached to one offloaded layer (the owner of several module units)."""

    def __init__(self, units, owner: nn.Module, name: str, members: Iterable[tuple[int, list]]):
        self._units = units  # the offloader's `ModuleUnits`
        self._name = name
        self.positions = {id(p): position for position, params in members for p in params}
        self._num_calls = 0
        self.is_permanent = False
        self.active_mode: _UnitReads | None = None
        self._handles = [
            owner.register_forward_pre_hook(self._pre_forward),
            owner.register_forward_hook(self._post_forward, always_call=True),
        ]

    @property
    def is_verified(self) -> bool:
        """Checked over its first calls and found to read each unit inside its forward."""
        return self._num_calls >= NUM_CHECKED_CALLS and not self.is_permanent

    def compile_error(self) -> str:
        """Why this layer cannot run compiled yet (the check itself runs only eagerly)."""
        if self.is_permanent:
            return (
                f"{_MODULE_UNITS}: {self._name} reads module weights outside their modules, "
                "which torch.compile cannot check; use prefetch_unit='layer' to compile it"
            )
        return (
            f"{_MODULE_UNITS} under torch.compile: {self._name} has run "
            f"{self._num_calls} of the {NUM_CHECKED_CALLS} eager calls that check its weight "
            "reads; call the model without torch.compile first, or use prefetch_unit='layer'"
        )

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre_forward(self, module, args) -> None:
        if torch.compiler.is_compiling() or self.active_mode is not None:
            return
        if self._num_calls >= NUM_CHECKED_CALLS and not self.is_permanent:
            return
        mode = _UnitReads(self)
        mode.__enter__()
        self.active_mode = mode  # (a Ctrl-C before this line leaves a mode that checks nothing)

    def _post_forward(self, module, args, output) -> None:
        mode = self.active_mode
        if mode is not None:
            self.active_mode = None
            _pop(mode)
            self._num_calls += 1  # a checked call counts once it has run to its end

    def recover(self) -> None:
        """After a forward was abandoned (Ctrl-C): take its check off this thread's stack."""
        self.active_mode = None
        _remove_modes(lambda mode: isinstance(mode, _UnitReads) and mode._check is self)

    def ensure_loaded(self, position: int) -> None:
        """Before a read of unit `position`'s weights: fine inside its forward while its
        slot still holds it; anything else loads it (if needed) and waits for it."""
        if self._units.is_running(position):
            return
        self._units.ensure_loaded(position)
        if not self.is_permanent:
            self.is_permanent = True
            warnings.warn(
                f"{_MODULE_UNITS}: {self._name} reads the weights of "
                f"{self._units.unit_name(position)} outside that module's forward; its "
                "weight reads are checked from now on (exact, but slower): use "
                "prefetch_unit='layer' for this model",
                UserWarning,
                stacklevel=2,
            )


def _pop(mode: TorchFunctionMode) -> None:
    """Take `mode` off this thread's torch-function mode stack, wherever it is on it."""
    _remove_modes(lambda other: other is mode)


def _remove_modes(matches: Callable[[TorchFunctionMode], bool]) -> None:
    """Take every mode that `matches` off this thread's stack; the others stay, in order."""
    kept = []
    while torch._C._len_torch_function_stack():
        mode = torch._C._pop_torch_function_stack()
        if not matches(mode):
            kept.append(mode)
    for mode in reversed(kept):
        torch._C._push_on_torch_function_stack(mode)
