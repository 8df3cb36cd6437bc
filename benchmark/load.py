"""serve.py under load (bench.py --workload N --serve): the workload's requests sent over HTTP to
a server in a subprocess, all at once (one client thread each, streaming) or one at a time; with
--compare llama.cpp, the same requests all at once to llama-cpp-python's server on the GGUF file.

Each request is a token-id prompt to /v1/completions at temperature 0, the server started with
--ignore-eos, so every answer runs to its own max_tokens, as in the in-process systems. A trial
records each request's time to first token (from sending it to the first chunk with text) and
the whole run's seconds, first request sent to last answer read.

After its last trial the concurrent system runs the workload once more with faults among it:
100 bad requests (malformed JSON, wrong types, negative or oversized max_tokens, prompts beyond
the model's positions) and 8 clients that hang up mid-answer. It checks that every bad request
got its 4xx, that the good answers equal the clean run's, and that the pool has every block back.

llama-cpp-python's server takes text prompts only: it gets each prompt's ids decoded to text,
which it tokenizes again (the counts differ a little; both report their own), and no EOS through
a logit bias. It answers one request at a time, and by default cuts a running stream short when
another request arrives: the benchmark turns that off (--interrupt_requests False), so that
every answer runs to its end.
"""

import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmark.workers import Loaded
from benchmark.workload import ServingTrial, ServingWorkload, dtype_name, progress
from engine.scheduler import Request
from errors import UserError
from weights.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 600  # loading and compiling a model
REQUEST_TIMEOUT_S = 1800
HANG_UPS = 8
BAD_REQUESTS = 100


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: int  # the usage's completion_tokens
    ttft_s: float


class ServerProcess:
    """A server in a subprocess on a free port of 127.0.0.1: `command(port)` starts it, and it is
    ready once GET `ready_path` answers 200."""

    def __init__(self, command: Callable[[int], list[str]], ready_path: str):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"serve-bench-{self.port}.log"
        self.log = open(self.log_path, "w")
        self.process = subprocess.Popen(command(self.port), stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise UserError(f"the server exited while starting; its log: {self.log_path}")
            try:
                if self.get(ready_path)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        self.stop()
        raise UserError(f"the server was not ready after {START_TIMEOUT_S} s; its log: {self.log_path}")

    def get(self, path: str) -> tuple[int, Any]:
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=30)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def peak_memory_bytes(self) -> int:
        """The server process's resident high-water mark (Linux)."""
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        return 0

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


def serve_py(w: ServingWorkload, pool_blocks: int, port: int) -> list[str]:
    """serve.py with the workload's model, rows and pool; no EOS, so every answer runs to its max_tokens."""
    return [
        sys.executable, str(REPO / "serve.py"), "--checkpoint", str(w.checkpoint), "--port", str(port), "--dtype", dtype_name(w.dtype),
        "--device", w.device.type, "--max-batch", str(w.max_batch), "--max-waiting", str(len(w.requests) + BAD_REQUESTS + HANG_UPS),
        "--context", str(w.row_slots), "--kv-blocks", str(pool_blocks), "--block-size", str(w.pages.block_size), "--ignore-eos",
        "--compile" if w.compile else "--no-compile", "--quant", w.quant, "--group-size", str(w.group_size), "--kv-dtype", w.kv_dtype,
        *compression_options(w),
    ]


def llama_server(gguf: Path, context: int, threads: int, port: int) -> list[str]:
    return [
        sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--n_ctx", str(context), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--interrupt_requests", "False",  # by default a waiting request cuts the running stream short
    ]


def compression_options(w: ServingWorkload) -> list[str]:
    c = w.compression
    if not c.enabled:
        return []
    return ["--kv-policy", c.policy, "--kv-budget", str(c.budget), "--kv-hysteresis", str(c.hysteresis), "--kv-window", str(c.window)]


def completion_body(request: Request, stream: bool) -> dict:
    return {"prompt": request.prompt, "max_tokens": request.max_new_tokens, "temperature": 0, "stream": stream, "stream_options": {"include_usage": True}}


def streamed_chunks(port: int, path: str, body: dict) -> Iterator[tuple[float, dict]]:
    """A streamed request's chunks as they come, each with the seconds since it was sent; a
    status other than 200 is one clear error."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        sent = time.perf_counter()
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        if response.status != 200:
            raise UserError(f"the server answered {response.status}: {response.read()[:300]!r}")
        for line in response:
            if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                yield time.perf_counter() - sent, json.loads(line[6:])
    finally:
        connection.close()


def stream_one(port: int, body: dict) -> Answer:
    """One streamed completion, read to its end. Its tokens: the usage's count, else (a server
    that streams no usage) max_tokens when it ended on its length."""
    pieces, tokens, first, seconds = [], 0, None, 0.0
    for seconds, chunk in streamed_chunks(port, "/v1/completions", body):
        if chunk["choices"] and chunk["choices"][0]["text"]:
            first = first or seconds
            pieces.append(chunk["choices"][0]["text"])
        if chunk["choices"] and chunk["choices"][0].get("finish_reason") == "length":
            tokens = tokens or body["max_tokens"]
        if chunk.get("usage"):
            tokens = chunk["usage"]["completion_tokens"]
    return Answer("".join(pieces), tokens, first or seconds)


def run_all(port: int, requests: list[Request], concurrent: bool, faults: bool = False, body: Callable[[Request], dict] | None = None) -> tuple[list[Answer], float, dict]:
    """Every request, all at once (a thread each) or in order; with faults, the bad requests and
    hang-ups among them; body: a request's JSON (default: completion_body). Returns the answers,
    the seconds, and what the faults got."""
    body = body or (lambda request: completion_body(request, True))
    answers: dict[int, Answer] = {}
    failures: list[str] = []
    start = time.perf_counter()

    def ask(i: int) -> None:
        try:
            answers[i] = stream_one(port, body(requests[i]))
        except Exception as e:  # reported once every thread is done
            failures.append(f"request {i}: {e}")

    fault_results: dict = {"bad": [], "hung_up": 0}
    if not concurrent:
        for i in range(len(requests)):
            ask(i)
    else:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(requests))]
        if faults:
            threads += [threading.Thread(target=send_bad, args=(port, k, fault_results["bad"])) for k in range(BAD_REQUESTS)]
            threads += [threading.Thread(target=hang_up, args=(port, requests[k % len(requests)], fault_results)) for k in range(HANG_UPS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(REQUEST_TIMEOUT_S)
    seconds = time.perf_counter() - start
    if failures:
        raise UserError("; ".join(failures[:3]))
    return [answers[i] for i in range(len(requests))], seconds, fault_results


def bad_request(k: int) -> bytes:
    """The k-th bad request, of a few kinds in turn, each one a client error."""
    kinds = [
        b"{\"prompt\": [1, 2",  # malformed JSON
        json.dumps({"prompt": "hi", "max_tokens": -5}).encode(),
        json.dumps({"prompt": "hi", "max_tokens": "lots"}).encode(),
        json.dumps({"prompt": "hi", "max_tokens": 10**7}).encode(),  # beyond the model's positions
        json.dumps({"prompt": [1] * 200_000, "max_tokens": 8}).encode(),  # a prompt longer than any row
        json.dumps({"prompt": "hi", "temperature": "hot"}).encode(),
        json.dumps({"prompt": "hi", "n": 1000}).encode(),  # more answers than a request may ask
        json.dumps({"messages": []}).encode(),
    ]
    return kinds[k % len(kinds)]


def send_bad(port: int, k: int, statuses: list) -> None:
    path = "/v1/chat/completions" if k % 8 == 7 else "/v1/completions"
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=REQUEST_TIMEOUT_S)
    try:
        connection.request("POST", path, bad_request(k), {"Content-Type": "application/json"})
        response = connection.getresponse()
        body = json.loads(response.read())
        statuses.append((response.status, "error" in body))
    finally:
        connection.close()


def hang_up(port: int, request: Request, results: dict) -> None:
    """A streaming client that reads its first few chunks, then closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=REQUEST_TIMEOUT_S) as s:
        body = json.dumps(completion_body(request, True)).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        received = b""
        while received.count(b"data: ") < 4:
            chunk = s.recv(65536)
            if not chunk:
                return
            received += chunk
    results["hung_up"] += 1


def load_server(w: ServingWorkload, pool_blocks: int, concurrent: bool) -> Loaded:
    """A worker's system: the server started, one warm-up run of the whole workload done."""
    progress(f"serve.py ({'all at once' if concurrent else 'one at a time'}): starting the server with {w.checkpoint} as {dtype_name(w.dtype)}")
    server = ServerProcess(partial(serve_py, w, pool_blocks), "/health")
    last: list[list[Answer]] = []

    def measure(requests: list[Request] = w.requests) -> ServingTrial:
        answers, seconds, _ = run_all(server.port, requests, concurrent)
        last[:] = [answers]
        stats = server.get("/stats")[1]
        return ServingTrial(seconds, sum(a.tokens for a in answers), stats["kv_peak_bytes"], stats["most_running"], [a.ttft_s for a in answers])

    def extras() -> dict:
        """The last trial's answers, the server's peak memory, and (all at once) the run with faults."""
        result = {"texts": [a.text for a in last[0]], "tokens": [a.tokens for a in last[0]], "peak_mem_bytes": server.peak_memory_bytes()}
        if concurrent:
            progress("serve.py (all at once): the workload again, with 100 bad requests and 8 hang-ups among it")
            answers, _, faults = run_all(server.port, w.requests, True, faults=True)
            deadline = time.monotonic() + 60
            while (stats := server.get("/stats")[1])["running"] + stats["waiting"] and time.monotonic() < deadline:
                time.sleep(0.1)
            result["faults"] = {
                "bad_requests": len(faults["bad"]),
                "bad_with_4xx_error_body": sum(400 <= status < 500 and has_error for status, has_error in faults["bad"]),
                "hung_up": faults["hung_up"],
                "answers_equal_clean_run": sum(a.text == b.text for a, b in zip(answers, last[0])),
                "answers": len(answers),
                "free_blocks": stats["free_blocks"],
                "pool_blocks": stats["pool_blocks"],
                "cancelled": stats["cancelled"],
            }
        server.stop()
        return result

    # The server compiled its step as it started; a few requests warm the rest (the first prefills).
    progress(f"serve.py ({'all at once' if concurrent else 'one at a time'}): warm-up run of {w.max_batch} requests")
    measure(w.requests[: w.max_batch])
    return Loaded(measure, extras)


def load_llama_server(w: ServingWorkload, gguf: Path, threads: int) -> Loaded:
    """A worker's system: llama-cpp-python's server on the GGUF file, every request at once."""
    progress(f"llama-cpp-python's server: starting it on {gguf}, {threads} threads")
    tokenizer = Tokenizer.from_dir(w.checkpoint)
    no_eos = {str(token): -100.0 for token in tokenizer.eos_ids}

    def body(request: Request) -> dict:
        text = tokenizer.decode(request.prompt)
        return {"prompt": text, "max_tokens": request.max_new_tokens, "temperature": 0, "stream": True, "logit_bias": no_eos}

    server = ServerProcess(partial(llama_server, gguf, 2 * w.row_slots, threads), "/v1/models")

    def measure(requests: list[Request] = w.requests) -> ServingTrial:
        answers, seconds, _ = run_all(server.port, requests, True, body=body)
        return ServingTrial(seconds, sum(a.tokens for a in answers), 0, 1, [a.ttft_s for a in answers])

    def extras() -> dict:
        result = {"peak_mem_bytes": server.peak_memory_bytes()}
        server.stop()
        return result

    progress(f"llama-cpp-python's server: warm-up run of {w.max_batch} requests")
    measure(w.requests[: w.max_batch])
    return Loaded(measure, extras)
