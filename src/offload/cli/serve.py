"""`offload serve`: load the model, then answer the OpenAI API over HTTP until SIGINT or
SIGTERM (which end the streams in flight and exit 0)."""

from __future__ import annotations

import argparse
import contextlib
import functools
import signal
import sys
import threading

from offload.cli.listening import listening, on_signals
from offload.cli.options import SPECULATIVE_HELP
from offload.config import OffloadConfig
from offload.config.limits import DEFAULT_MAX_REQUEST_BYTES
from offload.config.validate import integer
from offload.errors import ConfigError, OffloadError
from offload.model.default import DEFAULT_MODEL_NAME


def add_serve_flags(serve: argparse.ArgumentParser) -> None:
    """vLLM's `serve` flags where they apply; the offload flags come with the device ones."""
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", help="as --model")
    serve.add_argument("--model", help="a model folder, a .gguf file or a Hugging Face id "
                       "(default: SmolLM2-135M-Instruct)")  # fmt: skip
    serve.add_argument("--host", default="127.0.0.1", help="address to listen on "
                       "(0.0.0.0: every interface)")  # fmt: skip
    serve.add_argument("--port", type=int, default=8000, help="port to listen on")
    serve.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                       help="engine replicas, each a process with the whole model and its "
                       "own share of the cores, behind this one server (default: 1)")  # fmt: skip
    serve.add_argument("--served-model-name", help="the model's name in the API (default: "
                       "the --model given, or SmolLM2-135M-Instruct)")  # fmt: skip
    serve.add_argument("--api-key", help="requests to /v1 must carry 'Authorization: "
                       "Bearer KEY' (default: none, no key asked)")  # fmt: skip
    serve.add_argument("--max-model-len", type=int,
                       help="prompt plus output at most (default: the model's)")  # fmt: skip
    serve.add_argument("--max-num-seqs", type=int, default=16,
                       help="sequences decoded together in one step")  # fmt: skip
    serve.add_argument("--max-num-batched-tokens", type=int,
                       help="prefill prompts in chunks of this many tokens, each "
                       "riding in the running sequences' decode step (default: on a "
                       "CPU, as many a step as measured time allows while sequences "
                       "decode; else each prompt whole)")  # fmt: skip
    serve.add_argument("--max-waiting-requests", type=int,
                       help="requests that may wait beyond the running ones; more are "
                       "answered 503 at once (default: 8 x --max-num-seqs)")  # fmt: skip
    serve.add_argument("--trust-request-chat-template", action="store_true",
                       help="let a request's own chat_template render (vLLM's flag; "
                       "off: such a request is answered 400)")  # fmt: skip
    serve.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='tool_choice "auto": the model\'s text read back into tool calls '
                       "by --tool-call-parser (vLLM's flag; off: such a request is answered "
                       "400)")  # fmt: skip
    serve.add_argument("--tool-call-parser", metavar="NAME",
                       help="the format of the model's tool calls: hermes (Qwen2.5, Qwen3, "
                       "Hermes) or llama3_json (Llama 3.1, 3.2) (default: none, no tool_choice auto)")  # fmt: skip
    serve.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                       help='tool_choice "none": the chat template gets no tools (default: '
                       "it gets them, and the answer is text)")  # fmt: skip
    serve.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="a request body at most this many bytes; a larger one is "
                       "answered 413")  # fmt: skip
    serve.add_argument("--no-offload", action="store_true", help="keep every weight on the device")
    serve.add_argument("--kv-offload", action="store_true",
                       help="keep the KV cache in host memory, streamed per layer")  # fmt: skip
    serve.add_argument("--swap-space", type=float, default=0,
                       help="GiB of host memory for the KV cache (> 0 keeps it in host "
                       "memory; its rows sized to fit)")  # fmt: skip
    serve.add_argument("--enforce-eager", action="store_true",
                       help="decode eagerly: no compiled CPU step (nor its compile at start)")  # fmt: skip
    serve.add_argument("--batch-invariant", action="store_true",
                       help="each answer the same whoever else is served (as "
                       "VLLM_BATCH_INVARIANT=1): eager steps, each prompt prefilled alone")  # fmt: skip
    serve.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=None, help="start a prompt from the longest prefix the KV "
                       "cache holds (vLLM's flag; default: on, off with --batch-invariant)")  # fmt: skip
    serve.add_argument("--speculative-config", metavar="JSON", help=SPECULATIVE_HELP)
    serve.add_argument("--no-progress", action="store_true", help="no loading progress bar")


def run_serve(args: argparse.Namespace) -> int:
    integer("--data-parallel-size", args.data_parallel_size, 1, what=">= 1")
    if args.data_parallel_size > 1:
        from offload.cli.replicated import serve_replicas

        return serve_replicas(args)
    try:
        with _stop_while_loading():
            return _checked_and_served(args)
    except _Stopped as stopped:
        print(f"offload serve: stopped by {stopped.signal_name}", file=sys.stderr)
        return 0


def _checked_and_served(args: argparse.Namespace) -> int:
    from offload.server.tools import server_tools

    server_tools(args.enable_auto_tool_choice, args.tool_call_parser)  # (before the load)
    from offload.cli.models import spec_of

    integer("--port", args.port, 0, 65535, what="in [0, 65535]")
    integer("--max-num-seqs", args.max_num_seqs, 1, what=">= 1")
    waiting = args.max_waiting_requests
    if waiting is None:
        waiting = 8 * args.max_num_seqs
    integer("--max-waiting-requests", waiting, 0, what=">= 0")
    integer("--max-request-bytes", args.max_request_bytes, 1, what=">= 1")
    name = args.model_tag or args.model
    if args.model_tag and args.model and args.model_tag != args.model:
        raise ConfigError("give the model once: as MODEL or as --model")
    config = OffloadConfig.from_cli_args(args)
    spec = spec_of(args, name, config)
    # The port is taken before the model loads (as vLLM does): a busy port is an error in
    # a second, not after a load of minutes.
    with listening(args.host, args.port) as sock:
        return _serve(args, sock, spec, config, name, waiting)


class _Stopped(KeyboardInterrupt):
    """SIGINT or SIGTERM before the server serves: the load stops as at a Ctrl-C (which
    every loading step undoes cleanly), and `offload serve` exits 0 with one line."""

    def __init__(self, signum: int):
        super().__init__()
        self.signal_name = signal.Signals(signum).name


@contextlib.contextmanager
def _stop_while_loading():
    def stop(signum, frame) -> None:
        raise _Stopped(signum)

    with on_signals(stop):
        yield


def _serve(args, sock, spec, config, name, waiting) -> int:
    import uvicorn

    from offload.cli.options import package_version
    from offload.server.app import ServeSettings, make_app

    progress = not args.no_progress and sys.stderr.isatty()
    llm = serve_llm(args, spec, config, progress)
    settings = ServeSettings(
        model_name=args.served_model_name or name or DEFAULT_MODEL_NAME,
        api_key=args.api_key,
        max_waiting=waiting,
        version=package_version(),
        trust_request_chat_template=args.trust_request_chat_template,
        max_request_bytes=args.max_request_bytes,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        tool_call_parser=args.tool_call_parser,
        exclude_tools_when_tool_choice_none=args.exclude_tools_when_tool_choice_none,
    )
    # The engine's loop runs on this (the main) thread and HTTP on another: on a CPU,
    # torch's OpenMP teams are only fast while one thread leads them (a 16-sequence step
    # took far less time so: docs/benchmarks.md).
    serving = llm.serving(fixed_length=args.max_model_len is not None, engine_thread=False)
    try:
        serving.warm_up()  # the compiled decode step before any request waits on it
    except BaseException:
        serving.close()
        llm.close()
        raise
    app = make_app(llm, settings)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="warning",
            access_log=False,
            timeout_graceful_shutdown=3,
            lifespan="on",
        )
    )
    port = sock.getsockname()[1]  # (the one the system chose for --port 0)
    budget = ""
    if llm.host_budget is not None:  # (a CPU with cpu_memory_gb: it bounds the process)
        budget = (
            f"; peak RSS within {llm.host_budget.budget_bytes / 2**30:.2f} GiB and the fixed "
            f"overhead {llm.fixed_overhead.describe()}"
        )
    room = serving.core.scheduler.room  # (where rows take memory as they write: shared)
    rows = f"{serving.core.max_rows} sequences at once"
    if room is not None:
        rows += f" in a KV room of {room} positions"
    if hasattr(serving.core, "cores"):  # (over a pipeline: `MicroBatches`)
        rows += f", {len(serving.core.cores)} micro-batches in flight"
    print(
        f"offload serve: {settings.model_name} on http://{args.host}:{port}/v1 "
        f"({llm.offloader.__class__.__name__}, {rows}{budget})",
        file=sys.stderr,
        flush=True,
    )
    http = threading.Thread(target=_serve_http, args=(server, serving, sock), name="offload-http")
    pipeline = llm._pipeline
    if pipeline is not None:  # (a rank lost: every later answer would fail, so it exits)
        pipeline.on_broken = functools.partial(_stop, server, serving)
    try:
        with _stopon_signals(server, serving):
            http.start()
            serving.core.run()  # until a signal, or the HTTP side stops
        http.join(timeout=10)
    finally:
        serving.close()
        llm.close()
    if pipeline is not None and pipeline.broken is not None:
        raise OffloadError(f"offload serve: {pipeline.broken}")
    if not server.started:
        raise OffloadError(f"offload serve could not listen on {args.host}:{args.port}")
    if not server.should_exit:  # (set by a signal only): the HTTP side ended by itself
        raise OffloadError("offload serve: the HTTP server stopped (see the lines above)")
    return 0


def serve_llm(args: argparse.Namespace, model, config: OffloadConfig, progress: bool = False):
    """The `LLM` that `offload serve` runs (`--enforce-eager`: no compiled CPU step), of
    `model`: its `ModelSpec` (or a folder)."""
    from offload.cli.models import llm_of

    return llm_of(
        args,
        model,
        config,
        max_num_seqs=args.max_num_seqs,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        swap_space=args.swap_space,
        kv_offload=args.kv_offload,
        progress=progress,
        enforce_eager=args.enforce_eager,
        batch_invariant=args.batch_invariant or None,  # (unset: VLLM_BATCH_INVARIANT decides)
        enable_prefix_caching=args.enable_prefix_caching,
    )


def _serve_http(server, serving, sock) -> None:
    try:
        server.run(sockets=[sock])  # (off the main thread uvicorn leaves the signals alone)
    finally:
        serving.close()  # the engine's loop on the main thread returns


@contextlib.contextmanager
def _stopon_signals(server, serving):
    """SIGINT and SIGTERM end the requests in flight at once (each gets an error saying
    why) and stop the HTTP server; the process then exits 0."""

    with on_signals(lambda signum, frame: _stop(server, serving)):
        yield


def _stop(server, serving) -> None:
    server.should_exit = True
    serving.close()  # in this thread: marks the loop stopped, joins nothing
