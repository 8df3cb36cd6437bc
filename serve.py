"""Serve a Llama / Mistral / Qwen checkpoint over the OpenAI API, every request in one continuous batch.

    python serve.py --checkpoint DIR                       (http://127.0.0.1:8000/v1)
    python serve.py --checkpoint DIR --max-batch 16 --kv-policy beacon --kv-budget 512

POST /v1/chat/completions and /v1/completions (streamed as server-sent events, or whole),
GET /v1/models, /health (503 while the model loads), /stats (rows, queue, free blocks) and
/metrics (Prometheus).
Requests join the batch between decode steps, each with its own sampling settings and seed, and
leave when done or when their client goes away. Sampling fields a request leaves out follow the
checkpoint's generation_config.json, else llama-cli's defaults, as generate.py does. SIGTERM or
Ctrl-C stops taking requests, lets the running ones finish, then exits.

HTTP: FastAPI (request checking, routes) on uvicorn (the ASGI server). No CUDA graph: the rows'
sampling settings change between steps, and a graph would keep the filters of its capture.
"""

import argparse
import errno
import json
import logging
import os
import socket
import sys
from pathlib import Path

import torch
import uvicorn

from cli import DTYPE_HELP, DTYPES, add_compression_args, add_paging_args, add_quant_args, checkpoint_and_quant, compression_config, pick_device, pick_dtype
from cli_features import attention_line, page_config
from engine.options import RunOptions
from engine.sampling import RowSampling, SamplingConfig
from engine.scheduler import ContinuousBatch, ContinuousSession, Request
from errors import UserError, run_command
from server.app import Served, build_app
from server.logprobs import TokenText
from server.metrics import Metrics
from server.structured import JsonGrammars
from server.worker import Worker
from weights.generation_config import sampling_defaults
from weights.forms import load_model
from weights.loader import read_config
from weights.tokenizer import Tokenizer

log = logging.getLogger("serve")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", help="model folder (config.json, safetensors, tokenizer.json); default: the bundled SmolLM2-135M-Instruct")
    p.add_argument("--host", default="127.0.0.1", help="the address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-batch", type=int, default=8, help="requests decoded at once, the rows of the batch")
    p.add_argument("--max-waiting", type=int, default=64, help="requests that may wait for a row; more get 429")
    p.add_argument("--context", type=int, help="cache slots per row: a request's prompt and answer together (default: the model's limit, at most 4096)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", *DTYPES], default="auto", help=DTYPE_HELP)
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=None,
        help="torch.compile the decode step at start (default: on CPU; a server runs long enough to repay it)",
    )
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="end a request that has run (or waited) this long with a 504; default: no limit (on a CPU a long prompt can take minutes)")
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-sequence token: every answer runs to its max_tokens (for load tests)")
    p.add_argument("--api-key", default=os.environ.get("BEACON_API_KEY"), help="clients must send 'Authorization: Bearer KEY' (default: $BEACON_API_KEY; /health and /metrics stay open)")
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN", help="let browser pages on these origins call the API (CORS), e.g. http://localhost:3000, or * for any")
    p.add_argument("--chat-template-kwargs", type=json_object, default={}, metavar="JSON", help="the chat template's extra variables for every request that does not set its own, e.g. '{\"enable_thinking\": false}'")
    p.add_argument("--seed", type=int, default=0, help="the random KV policy's seed (a request's draws follow its own seed field)")
    add_quant_args(p)
    add_compression_args(p)
    add_paging_args(p, "(always on: the server's rows share one paged pool)")
    args = p.parse_args(argv)
    if args.paged:
        p.error("--paged is always on here; drop it")
    return args


def json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object, e.g. '{\"enable_thinking\": false}'")
    return value


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return run_command(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    if args.max_batch < 1:
        raise UserError(f"--max-batch must be >= 1, got {args.max_batch}")
    if args.max_waiting < 0:
        raise UserError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    if args.timeout is not None and args.timeout <= 0:
        raise UserError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if not 0 < args.port < 65536:
        raise UserError(f"--port must be in 1..65535, got {args.port}")
    compression = compression_config(args)
    device = pick_device(args.device)
    checkpoint, quant = checkpoint_and_quant(args.checkpoint, args.quant, args.group_size)
    model_config = read_config(checkpoint)
    limit = model_config.max_position_embeddings
    context = min(limit, 4096) if args.context is None else args.context
    if not 2 <= context <= limit:
        raise UserError(f"--context must be between 2 and the model's {limit} positions, got {context}")
    tokenizer = Tokenizer.from_dir(checkpoint)
    dtype = pick_dtype(args.dtype, checkpoint, device, quant, rows=args.max_batch)
    pages = page_config(args, device, True)
    compile = device.type == "cpu" if args.compile is None else args.compile
    listening = listen(args.host, args.port)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    attention = attention_line(device, dtype, model_config, args.kv_dtype, pages, args.kv_store)
    if attention is not None:
        log.info("%s", attention)

    def start_batch(on_tokens) -> ContinuousBatch:
        """On the model's thread: load the model, and run a short request through the step (which compiles it)."""
        log.info("loading %s (%s)%s", checkpoint, str(dtype).removeprefix("torch."), "; compiling the decode step" if compile else "")
        model = load_model(checkpoint, dtype, device, quant, args.group_size)
        sampling = RowSampling([SamplingConfig()] * args.max_batch, device, seeded=True)
        options = RunOptions(compile=compile, compression=compression, pages=pages, kv_dtype=args.kv_dtype, prefix_cache=args.prefix_cache)
        eos_ids = frozenset() if args.ignore_eos else tokenizer.eos_ids
        session = ContinuousSession(model, args.max_batch, context, options, eos_ids=eos_ids, sampling=sampling)
        batch = ContinuousBatch(session, compression, on_tokens)
        batch.add("warm-up", Request(tokenizer.encode("Hello") or [0], 2))
        while batch.busy():
            batch.step()
        log.info(
            "serving %s on http://%s:%d/v1: %d rows of %d slots, a pool of %d blocks of %d slots",
            checkpoint.name, args.host, args.port, args.max_batch, context, batch.pool_blocks, session.cache.block_size,
        )
        return batch

    server: uvicorn.Server | None = None

    def stop_serving() -> None:
        if server is not None:
            server.should_exit = True

    metrics = Metrics(Path(checkpoint).name)
    worker = Worker(start_batch, args.max_batch, args.max_waiting, on_failed=stop_serving, metrics=metrics, timeout_s=args.timeout)
    served = Served(
        Path(checkpoint).name, tokenizer, sampling_defaults(checkpoint), model_config.vocab_size, TokenText(Path(checkpoint) / "tokenizer.json"), args.chat_template_kwargs,
        JsonGrammars(Path(checkpoint) / "tokenizer.json", model_config.vocab_size, tokenizer.eos_ids),
    )
    app = build_app(served, worker, metrics, args.api_key or None, args.allowed_origins)
    # No limit on the graceful shutdown: SIGTERM lets every running request finish.
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=None))
    worker.start()
    server.run(sockets=[listening])
    worker.stop()
    if worker.error is not None:
        raise worker.error if isinstance(worker.error, UserError) else UserError(f"the engine failed: {worker.error}")


def listen(host: str, port: int) -> socket.socket:
    """The server's socket, bound before the model loads: a port in use is one clear error, not a
    failure after minutes of loading (and requests meanwhile get 503, not a refused connection)."""
    try:
        socket.getaddrinfo(host, port)
    except socket.gaierror as e:
        raise UserError(f"--host {host} is not an address ({e.strerror}); give one such as 127.0.0.1, or 0.0.0.0 for every interface") from None
    try:
        return socket.create_server((host, port))
    except OSError as e:
        remedy = "pick another --port, or stop what listens there" if e.errno == errno.EADDRINUSE else "give a --host of this machine"
        raise UserError(f"cannot listen on {host}:{port} ({os.strerror(e.errno)}); {remedy}") from None

if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
