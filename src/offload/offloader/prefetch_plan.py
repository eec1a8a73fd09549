"""Which layers and parameters the prefetch backend offloads: vLLM's group pattern,
narrowed by `offload_params`, without tied or resident-pinned weights."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable

from torch import nn

from offload.errors import ModelError
from offload.offloader.manifest import check_not_meta, warn_unmatched_segments
from offload.offloader.selection import matches_segments, offloaded_layer_indices
from offload.offloader.units import Unit


class LayerChoice:
    """The last `num_in_group` layers of every `group_size` are offloaded, and of them
    only the parameters matching `offload_params` (all, if empty)."""

    def __init__(self, group_size: int, num_in_group: int, offload_params: Iterable[str]):
        self.group_size = group_size
        self.num_in_group = num_in_group
        self.offload_params = set(offload_params)

    def layers(
        self,
        modules: list[nn.Module],
        resident_ids: set[int],
        name_of: Callable[[nn.Module, int], str],
        deferred: bool,
    ) -> list[Unit] | None:
        """One unit per chosen layer with something to offload: its parameters used by no
        other layer and not in `resident_ids`. None (with a warning) when the pattern
        picks no layer at all. Without `deferred`, a parameter on the meta device is
        refused."""
        indices = offloaded_layer_indices(len(modules), self.group_size, self.num_in_group)
        if not indices:
            # As in vLLM, a layout that selects no layer offloads nothing; say so.
            warnings.warn(self.nothing_to_offload(len(modules)), UserWarning, stacklevel=5)
            return None
        if self.offload_params:
            names = [n for i in indices for n, _ in modules[i].named_parameters()]
            warn_unmatched_segments("offload_params", names, self.offload_params)
        uses: dict[int, int] = {}
        for p in (p for module in modules for p in module.parameters()):
            uses[id(p)] = uses.get(id(p), 0) + 1
        layers = []
        for index in indices:
            module = modules[index]
            params = [
                (name, p)
                for name, p in module.named_parameters()
                if (not self.offload_params or matches_segments(name, self.offload_params))
                and uses[id(p)] == 1  # weights tied to another layer stay resident
                and id(p) not in resident_ids
            ]
            if not deferred:
                check_not_meta(params, f"layer {index}")
            if params:  # as vLLM: a layer with nothing to offload is not offloaded
                layers.append(Unit.of(module, name_of(module, index), params, index))
        return layers

    def nothing_to_offload(self, num_layers: int) -> str:
        """Why the settings offload nothing, naming them."""
        if self.offload_params:
            return (
                f"offload_params {sorted(self.offload_params)} match no parameter of the "
                f"offloaded layers (segments are matched whole, e.g. 'mlp' or 'q_proj')"
            )
        first = self.group_size - self.num_in_group
        return (
            f"offload_group_size={self.group_size} with offload_num_in_group="
            f"{self.num_in_group} offloads layers {first}, {first + 1}, ... but there are "
            f"only {num_layers} layers: nothing is offloaded"
        )

    def check_some_offloaded(self, units: list[Unit], num_layers: int) -> None:
        """Raise when `offload_params` selected nothing; warn when ties kept everything."""
        if not units and self.offload_params:
            raise ModelError(self.nothing_to_offload(num_layers))
        if not units:
            warnings.warn(
                "the parameters of the layers to offload are all tied to other modules and "
                "stay resident: nothing is offloaded",
                UserWarning,
                stacklevel=5,
            )
