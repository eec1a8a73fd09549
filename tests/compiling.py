"""Compiles that run inductor's passes again without compiling every kernel again."""

import contextlib

import torch


@contextlib.contextmanager
def graphs_compiled_anew():
    """Compiles in this block miss the caches of whole graphs (AOTAutograd's and
    inductor's), so every graph pass runs and can be counted, but take each kernel already
    built from inductor's cache: `force_disable_caches` would build every kernel again
    (a 2-layer bf16 step: 31 s against 13 s)."""
    import torch._functorch.config as functorch_config

    with (
        torch._inductor.config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
    ):
        yield
