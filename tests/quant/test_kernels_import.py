"""The package imports without dynamo (about 1 s of a process's start, `compile_options`),
and what `kernels` sets in place of dynamo's decorator is what the decorator sets."""

import subprocess
import sys

import torch

from offload.quant import kernels


def test_row_dot_built_is_marked_as_the_decorator_marks_it():
    def copy() -> bool:
        return True

    before = set(vars(copy))
    marked = torch.compiler.assume_constant_result(copy)
    added = {name: value for name, value in vars(marked).items() if name not in before}
    assert added  # (the decorator does mark something)
    for name, value in added.items():
        assert getattr(kernels._row_dot_built, name, None) == value


def test_the_api_the_cli_and_the_engine_import_without_dynamo():
    code = (
        "import sys; import offload.api, offload.llm, offload.cli.commands; "
        "print('torch._dynamo' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
