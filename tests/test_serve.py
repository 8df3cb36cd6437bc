"""serve.py end to end: a server in a subprocess on a free port of 127.0.0.1, on the tiny chat
checkpoint, driven by the official `openai` client and by raw HTTP for what a client library
would never send. Every wait is bounded; every server is stopped by its test."""

import fnmatch
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest

import generate
from weights.tokenizer import Tokenizer

REPO = Path(__file__).resolve().parent.parent
START_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, checkpoint: Path | None, *options: str, log_dir: Path | None = None):
        """checkpoint None: the bundled model."""
        self.port = free_port()
        self.log = open((log_dir or checkpoint.parent) / f"serve-{self.port}.log", "w+")
        argv = [sys.executable, str(REPO / "serve.py"), "--port", str(self.port), "--dtype", "float32", *options]
        argv += [] if checkpoint is None else ["--checkpoint", str(checkpoint)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def call(self, method: str, path: str, body: bytes | dict | None = None) -> tuple[int, dict]:
        """One request over raw HTTP; the status and the JSON answer."""
        data = body if body is None or isinstance(body, bytes) else json.dumps(body).encode()
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        try:
            connection.request(method, path, data, {"Content-Type": "application/json"})
            response = connection.getresponse()
            return response.status, json.loads(response.read())
        finally:
            connection.close()

    def get(self, path: str) -> tuple[int, dict]:
        return self.call("GET", path)

    def post(self, path: str, body: bytes | dict) -> tuple[int, dict]:
        return self.call("POST", path, body)

    def wait_ready(self) -> None:
        """Poll /health until 200."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.output()
            try:
                if self.get("/health")[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise AssertionError(f"the server was not ready in {START_TIMEOUT_S} s:\n{self.output()}")

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="unused", max_retries=0, timeout=60)

    def stop(self) -> int:
        """SIGTERM; the exit status (uvicorn ends a graceful shutdown by re-raising the signal: -SIGTERM)."""
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            self.log.close()

    def output(self) -> str:
        self.log.flush()
        self.log.seek(0)
        return self.log.read()


@pytest.fixture(scope="module")
def server(chat_checkpoint):
    running = Server(chat_checkpoint, "--no-compile", "--max-batch", "4", "--context", "256", "--max-waiting", "32")
    running.wait_ready()
    yield running
    assert running.stop() == -signal.SIGTERM


def generate_py(capsys, checkpoint: Path, *argv: str) -> str:
    code = generate.main(["--checkpoint", str(checkpoint), "--dtype", "float32", "--temperature", "0", "--no-compile", *argv])
    out, _ = capsys.readouterr()
    assert code == 0
    return out.removesuffix("\n")


def test_the_openai_client_gets_generate_py_answers_at_temperature_0(server, chat_checkpoint, capsys):
    client = server.client()
    assert [m.id for m in client.models.list().data] == [chat_checkpoint.name]
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about the fox 🦊"}]
    chat = client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_tokens=24, temperature=0)
    expected = generate_py(capsys, chat_checkpoint, "--system", "Be brief.", "--max-new-tokens", "24", "Tell me about the fox 🦊")
    assert chat.choices[0].message.content == expected and chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 24

    streamed = client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_completion_tokens=24, temperature=0, stream=True)
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == expected

    text = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=16, temperature=0)
    plain = generate_py(capsys, chat_checkpoint, "--no-chat", "--max-new-tokens", "16", "Once upon a time")
    assert text.choices[0].text == plain
    chunks = list(client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=16, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16 and chunks[-1].usage.prompt_tokens == text.usage.prompt_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    ids = Tokenizer.from_dir(chat_checkpoint).encode("Once upon a time")
    assert client.completions.create(model=chat_checkpoint.name, prompt=ids, max_tokens=16, temperature=0).choices[0].text == plain


def test_a_stop_string_or_eos_ends_with_finish_reason_stop(server, chat_checkpoint, capsys):
    client = server.client()
    whole = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=16, temperature=0).choices[0].text
    stop = whole[5:8]
    cut = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    # The tiny chat model says <|im_end|> (its EOS) early for some prompt: that answer ends with "stop" before its limit.
    for word in ["hi", "fox", "tell me", "why", "a", "b", "c", "dog", "sky", "ok"]:
        answer = client.chat.completions.create(model=chat_checkpoint.name, messages=[{"role": "user", "content": word}], max_tokens=200, temperature=0)
        if answer.usage.completion_tokens < 200:
            assert answer.choices[0].finish_reason == "stop"
            break


def test_logprobs_spell_the_answer_and_greedy_takes_the_likeliest(server, chat_checkpoint):
    """Chat's logprobs.content and the completions' lists, whole and streamed: the tokens' bytes
    spell the answer (the fox's emoji is split across tokens), and at temperature 0 each token is
    its own first alternative."""
    client = server.client()
    messages = [{"role": "user", "content": "Tell me about the fox 🦊"}]
    chat = client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens == 12
    assert b"".join(bytes(entry.bytes) for entry in content).decode(errors="replace") == chat.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].token == entry.token and entry.top_logprobs[0].logprob == entry.logprob
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
    streamed = client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=3, stream=True)
    pieces = [entry for chunk in streamed if chunk.choices and chunk.choices[0].logprobs for entry in chunk.choices[0].logprobs.content]
    assert [e.token for e in pieces] == [e.token for e in content]  # the prefix cache held its prompt: logprobs to rounding
    assert [e.logprob for e in pieces] == pytest.approx([e.logprob for e in content], abs=1e-5)
    plain = client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_tokens=12, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].message.content == chat.choices[0].message.content

    text = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=10, temperature=0, logprobs=2)
    lists = text.choices[0].logprobs
    spelled = [bytes.fromhex(t.removeprefix("bytes:").replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in lists.tokens]
    assert b"".join(spelled).decode(errors="replace") == text.choices[0].text and len(lists.token_logprobs) == 10
    assert lists.text_offset[0] == 0 and lists.text_offset == sorted(lists.text_offset) and lists.text_offset[-1] < len(text.choices[0].text)
    assert all(len(top) == 2 and max(top.values()) == lp for top, lp in zip(lists.top_logprobs, lists.token_logprobs))


def test_penalties_and_logit_bias_reach_the_answer(server, chat_checkpoint):
    client = server.client()
    tokenizer = Tokenizer.from_dir(chat_checkpoint)
    forced = tokenizer.encode("fox", add_special_tokens=False)[0]
    text = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=6, temperature=0, logit_bias={str(forced): 100})
    assert text.choices[0].text == tokenizer.decode([forced] * 6)
    # A bias of -100 on a greedy answer's first token changes it.
    plain = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=6, temperature=0, logprobs=0)
    first = plain.choices[0].logprobs.tokens[0]
    first_id = tokenizer.encode(first, add_special_tokens=False)[0]
    banned = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=6, temperature=0, logit_bias={str(first_id): -100}, logprobs=0)
    assert banned.choices[0].logprobs.tokens[0] != first
    # Penalties at their strongest stop greedy repeating itself.
    repeated = client.completions.create(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=40, temperature=0, logprobs=0).choices[0].logprobs.tokens
    penalised = client.completions.create(
        model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=40, temperature=0, logprobs=0, frequency_penalty=2, presence_penalty=2
    ).choices[0].logprobs.tokens
    assert len(set(penalised)) > len(set(repeated))


def test_a_common_system_prompt_is_prefilled_once_and_answers_do_not_change(server, chat_checkpoint, capsys):
    client = server.client()
    system = "You are a careful assistant. " * 5
    hits_before = scraped(server.port)[("beacon_prefix_cache_hit_tokens_total", (("model", chat_checkpoint.name),))]
    answers = []
    for question in ("Tell me about the fox", "Why is the sky blue?"):
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        answers.append(client.chat.completions.create(model=chat_checkpoint.name, messages=messages, max_tokens=10, temperature=0))
        expected = generate_py(capsys, chat_checkpoint, "--system", system, "--max-new-tokens", "10", question)
        assert answers[-1].choices[0].message.content == expected
    system_tokens = len(Tokenizer.from_dir(chat_checkpoint).encode_chat([{"role": "system", "content": system}], add_generation_prompt=False))
    cached = answers[1].usage.prompt_tokens_details.cached_tokens
    assert system_tokens - 16 < cached <= system_tokens and cached % 16 == 0  # its full blocks of 16 slots
    assert answers[0].usage.prompt_tokens_details.cached_tokens < cached
    hits = scraped(server.port)[("beacon_prefix_cache_hit_tokens_total", (("model", chat_checkpoint.name),))] - hits_before
    assert hits == sum(a.usage.prompt_tokens_details.cached_tokens for a in answers)


def test_n_answers_are_each_the_answer_of_its_own_seed_and_share_the_prompt(server, chat_checkpoint):
    client = server.client()
    messages = [{"role": "user", "content": "Tell me a story about a fox and a dog, in three short lines."}]
    sampled = {"model": chat_checkpoint.name, "messages": messages, "max_tokens": 8, "temperature": 0.9, "top_p": 0.95}
    three = client.chat.completions.create(**sampled, n=3, seed=40)
    alone = [client.chat.completions.create(**sampled, seed=40 + i) for i in range(3)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert [c.message.content for c in three.choices] == [a.choices[0].message.content for a in alone]
    assert len({c.message.content for c in three.choices}) > 1  # the seeds differ
    assert three.usage.prompt_tokens == alone[0].usage.prompt_tokens and three.usage.completion_tokens == 24
    assert three.usage.prompt_tokens_details.cached_tokens >= 16  # the prompt's full block, prefilled once

    chunks = list(client.chat.completions.create(**sampled, n=3, seed=40, stream=True, stream_options={"include_usage": True}))
    streamed = ["".join(c.choices[0].delta.content or "" for c in chunks if c.choices and c.choices[0].index == i) for i in range(3)]
    assert streamed == [c.message.content for c in three.choices]
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"] * 3
    assert chunks[-1].usage.completion_tokens == 24


def test_response_format_holds_the_answer_to_the_schema(server, chat_checkpoint):
    client = server.client()
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}, "color": {"enum": ["red", "green"]}, "count": {"type": "integer", "minimum": 1, "maximum": 9}},
        "required": ["ok", "color", "count"],
        "additionalProperties": False,
    }
    form = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    for temperature in (0, 1.0):
        for prompt in ("Once upon a time", "Give me JSON"):
            answer = client.completions.create(model=chat_checkpoint.name, prompt=prompt, max_tokens=60, temperature=temperature, seed=3, extra_body={"response_format": form})
            value = json.loads(answer.choices[0].text)
            assert answer.choices[0].finish_reason == "stop"  # the grammar allows EOS alone once the object is complete
            assert set(value) == {"ok", "color", "count"} and isinstance(value["ok"], bool) and value["color"] in ("red", "green") and 1 <= value["count"] <= 9
    chat = client.chat.completions.create(
        model=chat_checkpoint.name, messages=[{"role": "user", "content": "hi"}], max_tokens=60, temperature=0, response_format=form, n=2, seed=1
    )
    assert all(set(json.loads(c.message.content)) == {"ok", "color", "count"} for c in chat.choices)
    free = client.chat.completions.create(model=chat_checkpoint.name, messages=[{"role": "user", "content": "hi"}], max_tokens=40, temperature=0)
    with pytest.raises(json.JSONDecodeError):
        json.loads(free.choices[0].message.content)  # the tiny model writes no JSON of its own


def raw_get(port: int, path: str, headers: dict | None = None, method: str = "GET", body: str | None = None) -> tuple[int, dict, str]:
    """Status, headers and body text of one request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request(method, path, body, headers=headers or {})
        response = connection.getresponse()
        return response.status, {k.lower(): v for k, v in response.getheaders()}, response.read().decode()
    finally:
        connection.close()


def scraped(port: int) -> dict[tuple[str, tuple], float]:
    """/metrics parsed by the Prometheus client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    status, headers, text = raw_get(port, "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_the_requests_tokens_and_latencies(server, chat_checkpoint):
    model = (("model", chat_checkpoint.name),)
    before = scraped(server.port)
    client = server.client()
    answers = [client.completions.create(model=chat_checkpoint.name, prompt=p, max_tokens=7, temperature=0) for p in ("one", "two words", "three")]
    after = scraped(server.port)

    def grew(name: str, labels: tuple = model) -> float:
        return after[(name, labels)] - before.get((name, labels), 0.0)

    assert grew("beacon_generation_tokens_total") == sum(a.usage.completion_tokens for a in answers) == 21
    assert grew("beacon_prompt_tokens_total") == sum(a.usage.prompt_tokens for a in answers)
    assert grew("beacon_requests_total", (("finish_reason", "length"), *model)) == 3
    assert grew("beacon_time_to_first_token_seconds_count") == 3
    assert grew("beacon_inter_token_latency_seconds_count") == 3 * 6
    assert after[("beacon_kv_blocks_used", model)] == 0 and after[("beacon_requests_running", model)] == 0
    assert after[("beacon_kv_blocks", model)] == server.get("/stats")[1]["pool_blocks"]


def test_an_api_key_guards_every_route_but_health_and_metrics_and_cors_answers_preflights(chat_checkpoint, tmp_path):
    guarded = Server(chat_checkpoint, "--no-compile", "--context", "64", "--api-key", "sesame", "--allowed-origins", "http://app.example", "--no-prefix-cache", log_dir=tmp_path)
    try:
        guarded.wait_ready()
        port = guarded.port
        assert raw_get(port, "/metrics")[0] == 200
        for headers, says in [({}, "no API key given"), ({"Authorization": "Bearer wrong"}, "not this server's"), ({"Authorization": "sesame"}, "not this server's")]:
            status, answer_headers, body = raw_get(port, "/v1/models", headers)
            error = json.loads(body)["error"]
            assert status == 401 and error["code"] == "invalid_api_key" and says in error["message"] and answer_headers["www-authenticate"] == "Bearer"
        with pytest.raises(openai.AuthenticationError):
            guarded.client().models.list()
        keyed = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="sesame", max_retries=0, timeout=60)
        assert keyed.completions.create(model=chat_checkpoint.name, prompt="hi", max_tokens=2).usage.completion_tokens == 2
        for _ in range(2):  # --no-prefix-cache: prefilled whole every time
            usage = keyed.completions.create(model=chat_checkpoint.name, prompt="once upon a time " * 4, max_tokens=2).usage
            assert usage.prompt_tokens > 32 and usage.prompt_tokens_details.cached_tokens == 0

        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization, content-type"}
        status, headers, _ = raw_get(port, "/v1/chat/completions", preflight, method="OPTIONS")
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example" and "POST" in headers["access-control-allow-methods"]
        assert raw_get(port, "/v1/chat/completions", {**preflight, "Origin": "http://elsewhere.example"}, method="OPTIONS")[0] == 400
        status, headers, _ = raw_get(port, "/v1/models", {"Origin": "http://app.example", "Authorization": "Bearer sesame"})
        assert status == 200 and headers["access-control-allow-origin"] == "http://app.example"
    finally:
        guarded.stop()


def test_concurrent_streams_get_their_solo_answers(server, chat_checkpoint):
    """12 streaming clients at once, over 4 rows: every one completes, with the tokens it gets
    alone; a seeded sampled request draws the same alone and in the crowd."""
    client = server.client()
    name = chat_checkpoint.name
    requests = [dict(prompt=f"request {i}: " + "fox " * (2 + 3 * i), max_tokens=20 + 9 * i, temperature=0) for i in range(11)]
    requests.append(dict(prompt="a seeded one", max_tokens=40, temperature=1.0, top_p=0.9, seed=1234))
    alone = [client.completions.create(model=name, **r).choices[0].text for r in requests]
    got: dict[int, str] = {}
    errors = []

    def stream(i: int) -> None:
        try:
            got[i] = "".join(c.choices[0].text for c in client.completions.create(model=name, stream=True, **requests[i]))
        except Exception as e:  # reported below, with the index
            errors.append((i, e))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and [got.get(i) for i in range(len(requests))] == alone
    status, stats = server.get("/stats")
    assert status == 200 and stats["free_blocks"] == stats["pool_blocks"] and stats["running"] == stats["waiting"] == 0


BAD_REQUESTS = [
    ("/v1/chat/completions", b"{not json", "not valid JSON"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hello"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": "many"}, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 17}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "role"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 400}, "cache slots"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10_000}, "maximum of 512 positions; shorten the prompt or lower max_tokens"),
    ("/v1/completions", {"prompt": "fox " * 300}, "no room"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "one prompt"),
    ("/v1/completions", {"prompt": [5, 1_000_000]}, "token ids must be in"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes please"}, "stream"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", [1, 2], "body"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 3}, "top_logprobs needs logprobs: true"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"5": 101}}, "logit_bias: the bias of token 5 must be in [-100, 100]"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"999999": 1}}, "logit_bias: token id 999999 is not in the vocabulary"),
    ("/v1/completions", {"prompt": "hi", "logit_bias": {"the": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema"}}, "json_schema is given with type json_schema"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "yaml"}}, "response_format.type"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array", "uniqueItems": True}}}}, "uniqueItems"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}]}, "chat template never shows tools"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice 'required'"),
    ("/v1/chat/completions", {"messages": [{"role": "tool", "tool_call_id": "c1"}]}, "a tool message needs content"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1"}}]}]}, "arguments must be a JSON object"),
    ("/v1/completions", {"prompt": "hi", "echo": True}, "echo is not implemented"),
    # A field the API does not define is refused at any depth, named by its path.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {}}]}]}, "messages.0.content.0.cache_control is not a field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "examples": []}}]}, "tools.0.function.examples is not a field"),
    ("/v1/completions", {"prompt": "hi", "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {}, "version": 2}}}, "response_format.json_schema.version is not a field"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_usage": True, "chunk_size": 4}}, "stream_options.chunk_size is not a field"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{}", "index": 0}}]}]}, "messages.0.tool_calls.0.function.index is not a field"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f", "why": "x"}}}, "a named choice is"),
    ("/v1/completions", {"prompt": "hi", "stream": True, "stream_options": {"include_obfuscation": True}}, "include_obfuscation is not implemented"),
    # Under 'auto' a call is parsed from free text: a strict schema there would be a promise not kept.
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "strict function f is enforced only when the call is required"),
]


def test_fields_that_ask_for_nothing_are_accepted(server):
    """What clients send by default (null, false, 0, empty) changes nothing and is no reason for a 400."""
    neutral = {
        "logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "tools": [], "tool_choice": "auto", "response_format": {"type": "text"},
        "stream_options": {"include_usage": False, "include_obfuscation": False},
    }
    status, answer = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **neutral})
    assert status == 200, answer


# Every field of the OpenAI reference's request bodies (chat completions, completions), each with
# a value that asks for something. Each one is served, or refused with a 400 that names it.
CHAT_FIELDS = {
    "messages": [{"role": "user", "content": "hi", "name": "ann"}], "model": None, "audio": {"voice": "alloy", "format": "wav"},
    "frequency_penalty": 0.5, "function_call": {"name": "f"}, "functions": [{"name": "f"}], "logit_bias": {"5": 1}, "logprobs": True,
    "max_completion_tokens": 3, "max_tokens": 3, "metadata": {"k": "v"}, "modalities": ["text", "audio"], "n": 2,
    "parallel_tool_calls": False, "prediction": {"type": "content", "content": "x"}, "presence_penalty": 0.5, "prompt_cache_key": "k",
    "reasoning_effort": "low", "response_format": {"type": "json_object"}, "safety_identifier": "u1", "seed": 1, "service_tier": "flex",
    "stop": ["x"], "store": True, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.5,
    "tool_choice": "auto", "tools": [{"type": "function", "function": {"name": "f"}}], "top_logprobs": 2, "top_p": 0.5, "user": "u1",
    "verbosity": "low", "web_search_options": {},
}
COMPLETION_FIELDS = {
    "model": None, "prompt": "hi", "best_of": 2, "echo": True, "frequency_penalty": 0.5, "logit_bias": {"5": 1}, "logprobs": 2,
    "max_tokens": 3, "n": 2, "presence_penalty": 0.5, "seed": 1, "stop": "x", "stream": True, "stream_options": {"include_usage": True},
    "suffix": "end", "temperature": 0.5, "top_p": 0.5, "user": "u1",
}
SERVED = {"messages", "model", "frequency_penalty", "logit_bias", "logprobs", "max_completion_tokens", "max_tokens", "metadata", "n", "presence_penalty",
          "prompt_cache_key", "parallel_tool_calls", "response_format", "safety_identifier", "seed", "stop", "stream", "stream_options", "temperature", "tool_choice",
          "top_logprobs", "top_p", "user", "prompt"}  # fmt: skip
# tools: this checkpoint's template never shows them, a 400 naming them (tests/test_tools.py serves them).


@pytest.mark.parametrize("path,fields", [("/v1/chat/completions", CHAT_FIELDS), ("/v1/completions", COMPLETION_FIELDS)])
def test_every_field_of_the_reference_is_served_or_refused_by_name(server, path, fields):
    needed = {"messages": fields.get("messages"), "prompt": fields.get("prompt"), "max_tokens": 3}
    needed = {k: v for k, v in needed.items() if k in fields}
    for name, value in fields.items():
        body = needed | {name: value}
        if name == "top_logprobs":
            body["logprobs"] = True
        if name == "stream_options":
            body["stream"] = True
        status, _, text = raw_get(server.port, path, {"Content-Type": "application/json"}, "POST", json.dumps(body))  # streamed or not
        if name in SERVED:
            assert status == 200, (name, text)
        else:
            assert status == 400 and name in json.loads(text)["error"]["message"], (name, text)
    status, answer = server.post(path, needed | {"ignore_eos": True})
    assert status == 400 and "ignore_eos is not a field this server knows" in answer["error"]["message"]


@pytest.mark.parametrize("path,body,says", BAD_REQUESTS, ids=range(len(BAD_REQUESTS)))
def test_a_bad_request_gets_a_400_with_an_openai_error_body(server, path, body, says):
    status, answer = server.post(path, body)
    assert status == 400, answer
    assert set(answer) == {"error"} and answer["error"]["type"] == "invalid_request_error" and says in answer["error"]["message"]


def test_unknown_models_and_routes_get_404s_and_the_server_lives_on(server, chat_checkpoint):
    status, answer = server.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"})
    assert status == 404 and answer["error"]["code"] == "model_not_found" and f"serves '{chat_checkpoint.name}'" in answer["error"]["message"]
    status, answer = server.get("/v1/engines")
    assert status == 404 and "error" in answer
    assert server.get("/health")[0] == 200


def send_raw(s: socket.socket, body: dict) -> None:
    """A completion request written straight to a socket, so that the test decides when to hang up."""
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data))


def read_some_then_hang_up(port: int, n_events: int) -> None:
    """A streaming client that reads a few events and closes its connection mid-answer."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        send_raw(s, {"prompt": "fox " * 20, "max_tokens": 190, "stream": True, "temperature": 0})
        received = b""
        while received.count(b"data: ") < n_events:
            chunk = s.recv(4096)
            assert chunk, f"the server closed the stream first: {received[:300]}"
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK")


def test_clients_that_hang_up_free_their_rows_and_blocks(chat_checkpoint):
    """A slow server (one thread, a long context) so that the streams are cut mid-answer."""
    slow = Server(chat_checkpoint, "--no-compile", "--max-batch", "4", "--context", "256")
    try:
        slow.wait_ready()
        ask = dict(model=chat_checkpoint.name, prompt="still there?", max_tokens=4, temperature=0)
        before = slow.client().completions.create(**ask)
        hang_ups = [threading.Thread(target=read_some_then_hang_up, args=(slow.port, 3)) for _ in range(8)]
        for t in hang_ups:
            t.start()
        for t in hang_ups:
            t.join(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            stats = slow.get("/stats")[1]
            if stats["running"] == stats["waiting"] == 0:
                break
            time.sleep(0.05)
        assert stats["free_blocks"] == stats["pool_blocks"] and stats["running"] == stats["waiting"] == 0
        assert stats["cancelled"] + stats["served"] == 9 and stats["cancelled"] >= 1
        after = slow.client().completions.create(**ask)
        assert (after.choices[0].text, after.usage) == (before.choices[0].text, before.usage)
    finally:
        assert slow.stop() == -signal.SIGTERM


def test_over_the_queue_bound_a_request_gets_429_and_the_others_complete(chat_checkpoint):
    """One row and one waiting place: of 4 long requests sent at once, the two that find both
    taken get 429; the two taken complete."""
    small = Server(chat_checkpoint, "--no-compile", "--max-batch", "1", "--max-waiting", "1", "--context", "512")
    try:
        small.wait_ready()
        client = small.client()
        outcomes: dict[int, object] = {}

        def ask(i: int) -> None:
            try:
                outcomes[i] = client.completions.create(model=chat_checkpoint.name, prompt="fox", max_tokens=300, temperature=0).usage.completion_tokens
            except openai.RateLimitError as e:
                outcomes[i] = e

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        refused = [o for o in outcomes.values() if isinstance(o, openai.RateLimitError)]
        assert len(outcomes) == 4 and len(refused) == 2 and sorted(o for o in outcomes.values() if o not in refused) == [300, 300]
        assert refused[0].status_code == 429 and refused[0].body["code"] == "rate_limit_exceeded"
    finally:
        assert small.stop() == -signal.SIGTERM


def test_503_while_starting_then_compiled_answers_and_sigterm_drains_a_running_stream(chat_checkpoint, server):
    """A server that compiles its step at start: requests get 503 until it is ready; its answers
    equal the eager server's; SIGTERM mid-stream lets the stream finish, then the process exits."""
    compiled = Server(chat_checkpoint, "--compile", "--context", "512")
    try:
        loading = None
        deadline = time.monotonic() + START_TIMEOUT_S
        while loading is None and time.monotonic() < deadline and compiled.process.poll() is None:
            try:
                status, health = compiled.get("/health")
            except OSError:
                time.sleep(0.02)
                continue
            assert status == 503 and health == {"status": "starting"}, "ready before a request could see it start"
            loading = compiled.post("/v1/completions", {"prompt": "hi"})
        assert loading[0] == 503 and loading[1]["error"]["code"] == "not_ready"
        compiled.wait_ready()
        ask = dict(model=chat_checkpoint.name, prompt="Once upon a time", max_tokens=40, temperature=0)
        assert compiled.client().completions.create(**ask).choices[0].text == server.client().completions.create(**ask).choices[0].text

        stream = compiled.client().completions.create(model=chat_checkpoint.name, prompt="fox", max_tokens=400, temperature=0, stream=True, stream_options={"include_usage": True})
        next(stream)
        compiled.process.send_signal(signal.SIGTERM)
        rest = list(stream)
        assert rest[-1].usage.completion_tokens > 100 and rest[-2].choices[0].finish_reason in ("stop", "length")  # it ran on after the signal
        assert compiled.process.wait(timeout=60) == -signal.SIGTERM
    finally:
        compiled.stop()


@pytest.mark.real
def test_the_bundled_model_served_gives_generate_py_golden_answer(tmp_path):
    """SmolLM2 through serve.py, chat and streamed, at temperature 0: generate.py's answer
    (tests/test_real_models.py holds generate.py to it)."""
    bundled = Server(None, "--no-compile", "--max-batch", "4", log_dir=tmp_path)
    try:
        bundled.wait_ready()
        client = bundled.client()
        name = client.models.list().data[0].id
        question = [{"role": "user", "content": "What is the capital of France?"}]
        answer = client.chat.completions.create(model=name, messages=question, max_tokens=24, temperature=0)
        assert answer.choices[0].message.content == "The capital of France is Paris." and answer.choices[0].finish_reason == "stop"
        streamed = client.chat.completions.create(model=name, messages=question, max_tokens=24, temperature=0, stream=True)
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed) == "The capital of France is Paris."
    finally:
        assert bundled.stop() == -signal.SIGTERM


def test_a_client_that_hangs_up_while_waiting_for_a_row_never_takes_one(chat_checkpoint):
    one_row = Server(chat_checkpoint, "--no-compile", "--max-batch", "1", "--context", "512")
    try:
        one_row.wait_ready()
        client = one_row.client()
        long = client.completions.create(model=chat_checkpoint.name, prompt="fox", max_tokens=500, temperature=0, stream=True)
        next(long)
        with socket.create_connection(("127.0.0.1", one_row.port), timeout=30) as s:  # waits for the one row, then hangs up
            send_raw(s, {"prompt": "a second one", "max_tokens": 20, "stream": True})
            assert s.recv(4096).startswith(b"HTTP/1.1 200 OK")
        answer = "".join(chunk.choices[0].text for chunk in long)
        assert answer and one_row.get("/stats")[1]["cancelled"] == 1
        assert "cancelled after 0 tokens" in one_row.output()
    finally:
        assert one_row.stop() == -signal.SIGTERM


LISTEN_ERRORS = [  # patterns: the resolver's words (*) differ between C libraries
    ("127.0.0.1", "in use", "cannot listen on 127.0.0.1:{port} (Address already in use); pick another --port, or stop what listens there"),
    ("192.0.2.1", "free", "cannot listen on 192.0.2.1:{port} (Cannot assign requested address); give a --host of this machine"),
    ("nonexistent.invalid", "free", "--host nonexistent.invalid is not an address (*); give one such as 127.0.0.1, or 0.0.0.0 for every interface"),
]


@pytest.mark.parametrize("host,port_is,says", LISTEN_ERRORS, ids=["port in use", "not this machine", "no such name"])
def test_an_address_it_cannot_listen_on_is_one_clear_error(chat_checkpoint, host, port_is, says):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        if port_is == "in use":
            taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, str(REPO / "serve.py"), "--checkpoint", str(chat_checkpoint), "--host", host, "--port", str(port), "--no-compile"],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and fnmatch.fnmatchcase(lines[0], "error: " + says.format(port=port)), lines

def test_a_request_past_the_time_limit_ends_with_a_504_and_gives_its_row_back(chat_checkpoint):
    limited = Server(chat_checkpoint, "--no-compile", "--max-batch", "2", "--context", "512", "--ignore-eos", "--timeout", "0.3")
    try:
        limited.wait_ready()
        status, answer = limited.post("/v1/completions", {"prompt": "fox", "max_tokens": 500, "n": 2})  # hundreds of steps: far past 0.3 s
        assert status == 504 and answer["error"]["code"] == "timeout" and "--timeout" in answer["error"]["message"], answer
        with pytest.raises(openai.APIError, match="time limit of 0.3 s"):
            list(limited.client().completions.create(model=chat_checkpoint.name, prompt="fox", max_tokens=500, stream=True))
        status, answer = limited.post("/v1/completions", {"prompt": "fox", "max_tokens": 1})  # a short one still fits
        assert status == 200 and answer["choices"][0]["finish_reason"] == "length"
        stats = limited.get("/stats")[1]
        # The 504 cancels the request's other answer, unless that one ran out of time first.
        assert stats["timed_out"] + stats["cancelled"] == 3 and stats["timed_out"] >= 2 and stats["free_blocks"] == stats["pool_blocks"] and stats["running"] == stats["waiting"] == 0
    finally:
        assert limited.stop() == -signal.SIGTERM
