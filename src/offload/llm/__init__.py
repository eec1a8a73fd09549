"""The `LLM` facade, vLLM's offline API: `llm.py` (the class), its argument checks
(`args.py`, `checks.py`, `vllm_args.py`), `auto.py` (what `cpu_offload_gb="auto"` and
`offload plan` run: measure, then let the planner decide) and `streaming.py` (text shown
as it is generated)."""

from offload.llm.llm import LLM, CompletionOutput, RequestOutput

__all__ = ["LLM", "CompletionOutput", "RequestOutput"]
