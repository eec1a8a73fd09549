"""A packed checkpoint's settings checked against what each format allows and against its
tensors (issue 48): a value the de-quantization would ignore or misread is refused by
name, with what is allowed, before the model is built on it.

- settings: GPTQ `group_size` (-1 or a positive divisor of each layer's inputs) and
  `checkpoint_format` (gptq, gptq_v2); AWQ `group_size` (those vLLM's AWQ kernels take);
  compressed-tensors' `num_bits`, `strategy` and `group_size` per config group, and
  `targets` that name at least one module; FP8's `weight_block_size`;
- each layer's tensors: their dtypes, the number of groups its scales hold against the
  group size, an FP8 block scale's shape against the block size;
- values read at load (small tensors only): every scale finite (a NaN scale makes NaN
  logits that no dtype cures), GPTQ's `g_idx` a group of each input, compressed-tensors'
  `weight_shape` the layer's own.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from offload.errors import ModelError, shown
from offload.memory.safetensors import StoredTensor, read_into
from offload.quant.kinds import PackedKind, PackedMethod

GPTQ_FORMATS = ("gptq", "gptq_v2")
AWQ_GROUP_SIZES = (-1, 32, 64, 128)  # vLLM's AWQ (Marlin) kernels'
CT_STRATEGIES = ("tensor", "channel", "group", "block")  # a weight's, as read here
CT_BITS = {"int": (4, 8), "float": (8,)}
_SCALE_NAMES = ("scales", "weight_scale", "weight_scale_inv")
_INTEGERS = (torch.int32,)
_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_method_settings(
    method: PackedMethod | None, settings: Mapping[str, Any], where: object
) -> None:
    """The settings of `method` that the de-quantization reads or relies on."""
    if method == PackedMethod.GPTQ:
        group = settings.get("group_size", -1)
        if not _is_int(group) or not (group == -1 or group >= 1):
            raise ModelError(
                f"{where}: GPTQ group_size {shown(group)} is not read (read: -1, one group a "
                "row, or a positive divisor of each layer's inputs)"
            )
        fmt = settings.get("checkpoint_format", "gptq")
        if fmt not in GPTQ_FORMATS:
            raise ModelError(
                f"{where}: GPTQ checkpoint_format {shown(fmt)} is not read (read: "
                f"{', '.join(GPTQ_FORMATS)})"
            )
    awq_group = settings.get("group_size", 128)
    if method == PackedMethod.AWQ and (not _is_int(awq_group) or awq_group not in AWQ_GROUP_SIZES):
        raise ModelError(
            f"{where}: AWQ group_size {shown(settings.get('group_size'))} is not one AWQ's "
            f"kernels take (read: {', '.join(map(str, AWQ_GROUP_SIZES))})"
        )
    if method == PackedMethod.COMPRESSED_TENSORS:
        for name, weights in ct_weight_args(settings):
            _check_ct_weights(weights, f"{where}: config_groups.{name}.weights")
    if method == PackedMethod.FP8:
        block = settings.get("weight_block_size")
        if block is not None and not _is_block(block):
            raise ModelError(
                f"{where}: FP8 weight_block_size {shown(block)} is not read (read: none, or "
                "[rows, columns] of positive integers)"
            )


def _is_block(block: object) -> bool:
    return isinstance(block, list) and len(block) == 2 and all(_is_int(b) and b > 0 for b in block)


def ct_weight_args(settings: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    """Each compressed-tensors config group's weight arguments, by the group's name."""
    groups = settings.get("config_groups") or {}
    if not isinstance(groups, dict):
        raise ModelError(f"compressed-tensors config_groups {shown(groups)} is not a mapping")
    return [
        (name, group["weights"])
        for name, group in groups.items()
        if isinstance(group, dict) and isinstance(group.get("weights"), dict)
    ]


def _check_ct_weights(weights: Mapping[str, Any], where: str) -> None:
    kind = weights.get("type", "int")
    bits = weights.get("num_bits", 8)
    if kind not in CT_BITS or bits not in CT_BITS[kind]:
        allowed = "; ".join(f"{k}: {', '.join(map(str, b))}" for k, b in CT_BITS.items())
        raise ModelError(
            f"{where}: type {shown(kind)} of num_bits {shown(bits)} is not read ({allowed})"
        )
    strategy = weights.get("strategy", "tensor")
    if strategy not in CT_STRATEGIES:
        raise ModelError(
            f"{where}: strategy {shown(strategy)} is not read (read: {', '.join(CT_STRATEGIES)})"
        )
    group = weights.get("group_size")
    if strategy == "group" and not (_is_int(group) and group > 0):
        raise ModelError(f"{where}: group_size {shown(group)}; strategy group needs one > 0")
    if strategy == "block" and not _is_block(weights.get("block_structure")):
        raise ModelError(
            f"{where}: block_structure {shown(weights.get('block_structure'))}; strategy "
            "block needs [rows, columns] of positive integers"
        )


def check_targets(settings: Mapping[str, Any], model: nn.Module, where: object) -> None:
    """Each compressed-tensors target names a module of the model (a class name, a module
    name, or `re:` and a pattern), as compressed-tensors matches them."""
    groups = settings.get("config_groups") or {}
    names = [name for name, _ in model.named_modules()]
    classes = {type(module).__name__ for _, module in model.named_modules()}
    for group_name, group in groups.items():
        targets = group.get("targets", []) if isinstance(group, dict) else []
        for target in targets if isinstance(targets, list) else [targets]:
            if not _matches_any(target, names, classes):
                raise ModelError(
                    f"{where}: config_groups.{group_name} targets {shown(target)}, which "
                    "names no module of the model (a class name such as Linear, a module "
                    "name, or re:<pattern>)"
                )


def _matches_any(target: object, names: list[str], classes: set[str]) -> bool:
    if not isinstance(target, str):
        return False
    if target.startswith("re:"):
        try:
            pattern = re.compile(target[3:])
        except re.error:
            return False
        return any(pattern.match(name) for name in names)
    return target in classes or target in names


def check_layer(
    form: str,
    settings: Mapping[str, Any],
    tensors: Mapping[str, StoredTensor],
    module: nn.Linear,
    where: str,
) -> None:
    """One layer's tensors against its format: dtypes, groups, block scales (shapes only)."""
    kind = form.split(":")[0]
    if kind in (PackedKind.GPTQ, PackedKind.AWQ) and "scales" in tensors:
        _check_dtypes(tensors, where)
        group = settings.get("group_size", settings.get("q_group_size"))
        if group is not None:  # (else the scales say how many groups there are)
            _check_groups(tensors["scales"].shape[0], group, module.in_features, where)
    if kind == PackedKind.CT_PACKED:
        _check_ct_bits(form, settings, where)
    scale = tensors.get("weight_scale")
    if (
        kind in (PackedKind.CT_PACKED, PackedKind.CT_PLAIN)
        and scale is not None
        and len(scale.shape) == 2
    ):
        sizes = {
            w.get("group_size") for _, w in ct_weight_args(settings) if w.get("strategy") == "group"
        }
        if len(sizes) == 1:  # (one group size for every target: each layer's is known)
            _check_groups(scale.shape[1], sizes.pop(), module.in_features, where, "weight_scale")
    if kind == PackedKind.FP8 and form.count(":") == 2:
        rows, columns = (int(size) for size in form.split(":")[1:])
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        expected = (-(-module.out_features // rows), -(-module.in_features // columns))
        if scale is not None and tuple(scale.shape) != expected:
            raise ModelError(
                f"{where}.{scale.name.rsplit('.', 1)[-1]} has shape {list(scale.shape)}; blocks "
                f"of {rows}x{columns} over a {module.out_features}x{module.in_features} weight "
                f"need {list(expected)}"
            )


def _check_dtypes(tensors: Mapping[str, StoredTensor], where: str) -> None:
    for name, dtypes in (("qweight", _INTEGERS), ("qzeros", _INTEGERS), ("g_idx", _INTEGERS)):
        if name in tensors and tensors[name].dtype not in dtypes:
            raise ModelError(f"{where}.{name} is {tensors[name].dtype}; it must be int32")
    if tensors["scales"].dtype not in _FLOATS:
        raise ModelError(
            f"{where}.scales is {tensors['scales'].dtype}; it must be float16, bfloat16 or float32"
        )


def _check_groups(
    groups: int, group_size: int, in_features: int, where: str, scales: str = "scales"
) -> None:
    """The scales' groups are those `group_size` makes of the layer's inputs."""
    if group_size == -1:
        expected = 1
    elif in_features % group_size == 0:
        expected = in_features // group_size
    else:
        raise ModelError(
            f"{where}: group_size {group_size} does not divide its {in_features} inputs"
        )
    if groups != expected:
        raise ModelError(
            f"{where}.{scales} holds {groups} groups; group_size {group_size} over "
            f"{in_features} inputs makes {expected}"
        )


def _check_ct_bits(form: str, settings: Mapping[str, Any], where: str) -> None:
    bits = int(form.split(":")[1])
    said = {weights.get("num_bits") for _, weights in ct_weight_args(settings)} - {None}
    if said and bits not in said:
        raise ModelError(
            f"{where}.weight_packed holds {bits}-bit values; config_groups say num_bits "
            f"{', '.join(map(str, sorted(said)))}"
        )


def check_values(
    form: str, tensors: Mapping[str, StoredTensor], module: nn.Linear, where: str
) -> None:
    """The values of a layer's small tensors, read now: finite scales, GPTQ's g_idx within
    its groups, compressed-tensors' weight_shape the layer's."""
    for name in _SCALE_NAMES:
        if name in tensors:
            values = _read(tensors[name])
            if not bool(torch.isfinite(values).all()):
                bad = int((~torch.isfinite(values)).sum())
                raise ModelError(
                    f"{where}.{name} holds {bad} nan or inf values: the checkpoint is damaged "
                    "(a scale must be finite)"
                )
    kind = form.split(":")[0]
    if kind == PackedKind.GPTQ and "g_idx" in tensors:
        _check_g_idx(_read(tensors["g_idx"]), tensors["scales"].shape[0], module, where)
    if kind == PackedKind.CT_PACKED and "weight_shape" in tensors:
        shape = _read(tensors["weight_shape"]).flatten().tolist()
        if shape != [module.out_features, module.in_features]:
            raise ModelError(
                f"{where}.weight_shape says {shape}; the layer is "
                f"[{module.out_features}, {module.in_features}]"
            )


def _check_g_idx(g_idx: torch.Tensor, groups: int, module: nn.Linear, where: str) -> None:
    if tuple(g_idx.shape) != (module.in_features,):
        raise ModelError(
            f"{where}.g_idx has shape {list(g_idx.shape)}; it must be [{module.in_features}], "
            "one group an input"
        )
    low, high = int(g_idx.min()), int(g_idx.max())
    if low < 0 or high >= groups:
        raise ModelError(
            f"{where}.g_idx holds groups {low} to {high}; its scales hold groups 0 to {groups - 1}"
        )


def _read(stored: StoredTensor) -> torch.Tensor:
    values = torch.empty(stored.shape, dtype=stored.dtype)
    read_into(stored, values)
    return values
