"""llama.cpp beside us, on the same bytes: `llama-cpp-python` (a separate install: it
builds llama.cpp from source), with as many threads as torch uses here, on the GGUF file
as stored where we run it as stored, and on an F32 GGUF of the same weights where we run
them as float32. Its Python API decodes one sequence at a time, so a batch of B is B
sequences one after another, and a step's time is what all B took to get one more token
each."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from offload.bench.decode import Decoded
from offload.bench.method import Figures, Method, MethodUnavailable


class LlamaCpp(Method):
    name = "llama-cpp"
    label = (
        "llama.cpp (llama-cpp-python) on the same bytes (the GGUF as stored, or an F32 GGUF of "
        "its weights against our float32), the same threads, one sequence at a time"
    )

    def setting(self) -> dict[str, Any]:
        gguf = self.gguf_file()
        return {"gguf": gguf.name if gguf else None, "n_threads": torch.get_num_threads()}

    def gguf_file(self) -> Path | None:
        """The file llama.cpp runs: the GGUF as stored where ours runs it as stored, else
        an F32 GGUF of its weights (what our float32 conversion holds: the same bytes)."""
        gguf = self.prepared.gguf
        if gguf is None or self.prepared.workload.quantization is not None:
            return gguf
        return f32_path(gguf)

    def load(self) -> None:
        if self.prepared.gguf is None:
            raise MethodUnavailable("llama.cpp runs GGUF files: --model must be a .gguf file")
        if self.device.type != "cpu":
            raise MethodUnavailable("llama.cpp is run on the CPU only, beside a CPU workload")
        try:
            import llama_cpp
        except ImportError:
            raise MethodUnavailable(
                "llama-cpp-python is not installed (pip install llama-cpp-python; it builds "
                "llama.cpp from source)"
            ) from None
        workload = self.prepared.workload
        threads = torch.get_num_threads()
        self._logits_of = llama_cpp.llama_get_logits
        positions = workload.prompt_len + workload.output_len + 8
        path = self.gguf_file()
        if path != self.prepared.gguf:  # (the F32 GGUF of ours, written on first use)
            write_f32(self.prepared.gguf)
        self.model = llama_cpp.Llama(  # type: ignore[assignment]
            model_path=str(path),
            n_ctx=positions,
            n_batch=positions,  # (its logits are kept in n_batch rows, indexed by position)
            n_threads=threads,
            n_threads_batch=threads,
            verbose=False,
        )

    def run(self, ids: torch.Tensor) -> Decoded:
        llama: Any = self.model
        num_tokens = self.prepared.workload.output_len
        tokens, prefill_s, step_s = [], 0.0, [0.0] * (num_tokens - 1)
        for row in ids.tolist():
            llama.reset()
            started = time.perf_counter()
            llama.eval(row)
            chosen = [self._greedy(llama)]
            prefill_s += time.perf_counter() - started
            for step in range(num_tokens - 1):
                started = time.perf_counter()
                llama.eval(chosen[-1:])
                chosen.append(self._greedy(llama))
                step_s[step] += time.perf_counter() - started
            tokens.append(chosen)
        self.num_forwards += num_tokens * len(tokens)
        return Decoded(torch.tensor(tokens), prefill_s, step_s)

    def _greedy(self, llama: Any) -> int:
        """The most likely next token after the last `eval`: its last position's logits, as
        llama.cpp's context holds them (`Llama.scores` is filled only with logits_all)."""
        logits = self._logits_of(llama.ctx)
        return int(np.argmax(np.ctypeslib.as_array(logits, shape=(llama.n_vocab(),))))

    def figures(self) -> Figures:
        return Figures()  # (it maps the file and keeps it: nothing is offloaded)

    def close(self) -> None:
        if self.model is not None:
            self.model.close()  # type: ignore[operator]
        super().close()


def f32_path(source: Path) -> Path:
    """Where the F32 GGUF of `source` is kept (the cache folder, beside the converted models)."""
    from offload.memory.cache_trust import cache_folder

    return cache_folder() / f"{source.stem}.F32.gguf"  # (a checked folder of the user's own)


def write_f32(source: Path) -> Path:
    """An F32 GGUF of the GGUF `source` (written once, `f32_path`): every tensor de-quantized
    as `gguf`'s reference does (what our float32 conversion holds), the same names, order and
    settings."""
    import gguf

    out = f32_path(source)
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    part = out.with_name(out.name + ".part")
    from offload.model.gguf_fast import FastReader

    reader = FastReader(source)
    arch = reader.fields["general.architecture"].contents()
    writer = gguf.GGUFWriter(str(part), arch=arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue  # (the writer writes these itself)
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    for tensor in reader.tensors:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        writer.add_tensor(tensor.name, np.ascontiguousarray(values, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    part.rename(out)
    return out
