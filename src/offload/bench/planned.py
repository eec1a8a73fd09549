"""The plan as a method: what `offload plan` chooses for this workload under a device
budget that holds all but half the layers (the budget of accelerate's `device_map` row),
loaded and timed beside the hand settings, so that "the plan is never slower than the
best hand setting" is a measurement of one run."""

from __future__ import annotations

from typing import Any

from offload.bench.ours import Ours
from offload.config.limits import GPU_MEMORY_UTILIZATION
from offload.planner.choose import device_need
from offload.planner.layouts import Layout
from offload.planner.shape import ModelShape
from offload.sizes import GIB


class Planned(Ours):
    name = "plan"
    label = "ours as `offload plan` chooses, the device budget of half the layers"

    def device_budget_gb(self, shape: ModelShape) -> float:
        """`device_memory_gb` that holds the weights but half the layers, the KV cache of
        the largest batch and the activations, as the engine counts them."""
        work = self.prepared.workload
        half = sum(shape.layer_bytes[: shape.num_layers // 2])
        kv = shape.kv_bytes(max(work.batch_sizes), work.prompt_len + work.output_len)
        need = device_need(shape, shape.weight_bytes - half, kv)
        return need / GPU_MEMORY_UTILIZATION / GIB

    def load(self) -> None:
        from offload.llm.auto import plan_for
        from offload.model.build import build_empty
        from offload.model.loader import load_model
        from offload.planner.shape import shape_of

        work, prepared = self.prepared.workload, self.prepared
        context_len = work.prompt_len + work.output_len
        shape = shape_of(build_empty(prepared.path, prepared.dtype), context_len)
        self.plan = plan_for(
            prepared.path,
            self.device,
            dtype=str(prepared.dtype).removeprefix("torch."),
            context_len=context_len,
            batch_size=max(work.batch_sizes),
            device_memory_gb=self.device_budget_gb(shape),
            settings=prepared.settings,
        )
        self.model, self.offloader = load_model(
            prepared.path, self.plan.config, device=self.device, dtype=prepared.dtype
        )
        self.loaded()

    def setting(self) -> dict[str, Any]:
        chosen = self.plan.chosen
        return {
            "chosen": chosen.label,
            "config": self.plan.config.to_dict(),
            "predicted_step_s": chosen.time.step_s,
            "measured_at": self.plan.measured.measurements.measured_at,
        }

    def layout(self, shape: ModelShape) -> Layout:
        return self.plan.chosen.layout
