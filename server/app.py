"""The HTTP side: FastAPI routes for the OpenAI API, on uvicorn's event loop.

With an API key, every route but /health and /metrics wants `Authorization: Bearer KEY` (401
otherwise); with allowed origins, browsers on those origins may call it (CORS, preflight
included). A handler checks the request (types and ranges by pydantic; lengths against the cache and the
model), renders and encodes the prompt, and submits a Job to the model's thread; then it streams
the job's text as server-sent events, or waits for all of it. Every refusal is one OpenAI-shaped
error body with a 4xx status; a client that goes away cancels its job.
"""

import asyncio
import re
import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request as HTTPRequest
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from cli import AnswerText, sampling_with
from engine.scheduler import Request
from errors import UserError
from server.logprobs import TokenText
from server.metrics import Metrics
from server.structured import JsonGrammars
from engine.logit_rules import TokenLogprobs, TokenMask
from server.answer_parts import THINK_OPEN, AnswerParts, tool_format
from server.protocol import DONE, ChatRequest, CompletionRequest, Reply, ResponseFormat, error_body, event, usage_of
from server.worker import Busy, Failed, Finished, Job, NotReady, Piece, Worker
from weights.tokenizer import Tokenizer

DISCONNECT_POLL_S = 0.5  # how often a whole-answer request looks whether its client is still there
OPEN_PATHS = {"/health", "/metrics"}  # no API key needed: a load balancer's probe, a Prometheus scrape
# pydantic names the branch of a union it tried inside an error's location ('str', 'list[TextPart]',
# 'NamedToolChoice', "literal['none', ...]"); the client knows only its fields.
UNION_BRANCH = re.compile(r"^(str|int|float|bool|function-\w+\[.*\]|dict\[.*\]|list\[.*\]|literal\[.*\]|[A-Z]\w*)$")


@dataclass
class Served:
    """What the routes need to know of the model being served."""

    name: str  # the model id of /v1/models
    tokenizer: Tokenizer
    checkpoint_sampling: dict[str, float | int] | None  # generation_config.json's defaults
    vocab_size: int  # the model's: token ids of a prompt are below it
    token_text: TokenText  # how log-probabilities show tokens
    template_kwargs: dict  # the chat template's extra variables unless a request says otherwise (--chat-template-kwargs)
    grammars: JsonGrammars  # response_format's token masks


class Refused(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.body = status, error_body(message, kind, param, code)


def telling_first(error: dict) -> tuple[bool, bool]:
    """Of a request's errors, the one to report first: an unknown field, then any but the branches of
    a union that the value's type did not fit (their message names no field of the client's)."""
    return error["type"] != "extra_forbidden", error["type"].endswith("_type") or error["type"] == "literal_error"


def build_app(served: Served, worker: Worker, metrics: Metrics, api_key: str | None = None, allowed_origins: list[str] | None = None) -> FastAPI:
    app = FastAPI(title="beacon-engine", docs_url=None, redoc_url=None, openapi_url=None)

    if api_key is not None:
        expected = f"Bearer {api_key}".encode()

        @app.middleware("http")
        async def check_api_key(http: HTTPRequest, call_next):
            given = http.headers.get("authorization", "").encode()
            if http.url.path in OPEN_PATHS or secrets.compare_digest(given, expected):
                return await call_next(http)
            message = "no API key given: send the header 'Authorization: Bearer KEY'" if not given else "the API key is not this server's"
            return JSONResponse(error_body(message, code="invalid_api_key"), status_code=401, headers={"WWW-Authenticate": "Bearer"})

    if allowed_origins:  # added last, so it runs first: a preflight is answered before the key is asked for
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["GET", "POST"], allow_headers=["*"])

    @app.exception_handler(Refused)
    async def refused(_, e: Refused) -> JSONResponse:
        return JSONResponse(e.body, status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, e: RequestValidationError) -> JSONResponse:
        first = min(e.errors(), key=telling_first)
        if first["type"] == "json_invalid":
            return JSONResponse(error_body(f"the request body is not valid JSON ({first['ctx']['error']})"), status_code=400)
        where = ".".join(str(part) for part in first["loc"] if part != "body" and not UNION_BRANCH.match(str(part)))
        if first["type"] == "extra_forbidden":
            return JSONResponse(error_body(f"{where} is not a field this server knows; drop it (docs/serving.md lists the fields)", param=where), status_code=400)
        message = f"{where}: {first['msg']}" if where else f"the request body: {first['msg']}"
        return JSONResponse(error_body(message, param=where or None), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(_, e: HTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(e.detail), "not_found_error" if e.status_code == 404 else "invalid_request_error"), status_code=e.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        ready = worker.state == "ready"
        return JSONResponse({"status": "ok" if ready else worker.state}, status_code=200 if ready else 503)

    @app.get("/stats")
    async def stats() -> dict:
        return worker.stats()

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.scrape(worker.stats()), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "beacon-engine"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, http: HTTPRequest):
        template = served.tokenizer.chat_template
        if template is None:
            raise Refused(400, "this checkpoint has no chat template; use /v1/completions", param="messages")
        tools = body.offered_tools()
        calls_format = tool_format(template)
        if tools and calls_format is None:
            raise Refused(400, "tools: this checkpoint's chat template never shows tools to the model; drop them", param="tools")
        variables = {**served.template_kwargs, **(body.chat_template_kwargs or {}), **({"tools": tools} if tools else {})}
        try:
            text = served.tokenizer.render_chat([m.for_template() for m in body.messages], **variables)
        except UserError as e:  # the template refused the conversation (say, roles out of order)
            raise Refused(400, str(e), param="messages") from None
        thinking, calls_format = text.rstrip().endswith(THINK_OPEN), calls_format if tools else None
        prompt = served.tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
        reply = Reply(True, served.name, served.token_text if body.logprobs else None)
        forced, only, once = body.forced_calls()

        def new_mask() -> TokenMask | None:
            if forced:
                return served.grammars.tool_calls(tools, only, once, calls_format, thinking)
            return response_format_mask(body.response_format, thinking)

        return await answer(body, prompt, reply, http, new_mask, lambda: AnswerParts(thinking, calls_format))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HTTPRequest):
        reply = Reply(False, served.name, None if body.logprobs is None else served.token_text)
        return await answer(body, completion_prompt(body.prompt), reply, http, lambda: response_format_mask(body.response_format, False))

    def response_format_mask(form: ResponseFormat | None, thinking: bool) -> TokenMask | None:
        if form is None:
            return None
        return served.grammars.mask(form.type, form.json_schema and form.json_schema.json_schema, thinking)

    def completion_prompt(prompt: str | list[str] | list[int]) -> list[int]:
        """The prompt's token ids: a text encoded, or ids as given."""
        if isinstance(prompt, str):
            return served.tokenizer.encode(prompt)
        if prompt and isinstance(prompt[0], int):
            if not all(0 <= token < served.vocab_size for token in prompt):
                raise Refused(400, f"prompt: token ids must be in 0..{served.vocab_size - 1}", param="prompt")
            return list(prompt)
        if len(prompt) != 1:
            raise Refused(400, f"prompt: one prompt per request, got a list of {len(prompt)}", param="prompt")
        return served.tokenizer.encode(prompt[0])

    async def answer(
        body: ChatRequest | CompletionRequest,
        prompt: list[int],
        reply: Reply,
        http: HTTPRequest,
        new_mask: Callable[[], TokenMask | None],
        new_parts: Callable[[], AnswerParts] = lambda: AnswerParts(False, None, split_reasoning=False),
    ):
        """new_mask: each answer's grammar, if any; new_parts: how a chat answer splits into
        reasoning, content and tool calls (default: all content)."""
        jobs: list[Job] = []
        try:
            for index in range(body.n):  # the first one's prefill makes the prompt's blocks findable for the others
                jobs.append(submit(body, prompt, index, new_mask))
        except Refused:
            for job in jobs:
                worker.cancel(job)
            raise
        parts = [new_parts() for _ in jobs]
        if body.stream:
            return StreamingResponse(stream(jobs, reply, parts, len(prompt), body.include_usage), media_type="text/event-stream")
        return await whole(jobs, reply, parts, len(prompt), http)

    def submit(body: ChatRequest | CompletionRequest, prompt: list[int], index: int, new_mask: Callable[[], TokenMask | None]) -> Job:
        if body.model is not None and body.model != served.name:
            raise Refused(404, f"model '{body.model}' is not served here; this server serves '{served.name}'", "not_found_error", "model", "model_not_found")
        if not prompt:
            raise Refused(400, "the prompt is empty", param="prompt")
        try:
            sampling = sampling_with(body.given_sampling(), served.checkpoint_sampling)
            limit = body.answer_limit()
            room = worker.room(len(prompt))
            if room < 1:
                raise UserError(f"the prompt has {len(prompt)} tokens, which leaves no room for an answer; shorten it")
            seed = secrets.randbits(31) if body.seed is None else body.seed + index
            request = Request(prompt, room if limit is None else limit, sampling, seed, body.rules(), new_mask())
            worker.check(request)
            job = Job(request, AnswerText(served.tokenizer, body.stops()), asyncio.get_running_loop())
            worker.submit(job)
        except UserError as e:  # the engine's checks name generate.py's flag; an API client sets max_tokens
            raise Refused(400, str(e).replace("--max-new-tokens", "max_tokens")) from None
        except NotReady as e:
            raise Refused(503, f"{e}; retry shortly", "server_error", code="not_ready") from None
        except Busy as e:
            raise Refused(429, str(e), "rate_limit_error", code="rate_limit_exceeded") from None
        return job

    async def stream(jobs: list[Job], reply: Reply, parts: list[AnswerParts], prompt_tokens: int, include_usage: bool) -> AsyncIterator[str]:
        events: asyncio.Queue = asyncio.Queue()  # (answer index, event), the answers' events as they come

        async def forward(index: int, job: Job) -> None:
            while True:
                item = await job.events.get()
                events.put_nowait((index, item))
                if not isinstance(item, Piece):
                    return

        forwarding = [asyncio.create_task(forward(index, job)) for index, job in enumerate(jobs)]
        held: list[list[TokenLogprobs]] = [[] for _ in jobs]  # of tokens whose text the parts hold back
        ends: dict[int, Finished] = {}
        try:
            for index in range(len(jobs)):
                yield reply.first_chunk(index)
            while len(ends) < len(jobs):
                index, item = await events.get()
                if isinstance(item, Failed):
                    yield event(error_body(item.message, "server_error", code="timeout" if item.status == 504 else None))
                    return
                answer_parts = parts[index].push(item.text) if isinstance(item, Piece) else parts[index].finish()
                held[index] += item.logprobs if isinstance(item, Piece) else []
                for channel, text in answer_parts:
                    yield reply.chunk(index, channel, text, held[index])
                    held[index] = []
                if isinstance(item, Finished):
                    ends[index] = item
                    if parts[index].calls:
                        yield reply.calls_chunk(index, parts[index].calls)
                    yield reply.last_chunk(index, item.finish_reason, parts[index].calls)
            if include_usage:
                yield reply.usage_chunk(usage_of(prompt_tokens, list(ends.values())))
            yield DONE
        finally:
            for task in forwarding:
                task.cancel()
            for index, job in enumerate(jobs):
                if index not in ends:  # the client went away (the response was cancelled), or one answer failed
                    worker.cancel(job)

    async def whole(jobs: list[Job], reply: Reply, parts: list[AnswerParts], prompt_tokens: int, http: HTTPRequest) -> JSONResponse:
        choices, ends = [], []
        for index, job in enumerate(jobs):
            pieces, logprobs = [], []
            while True:
                try:
                    item = await asyncio.wait_for(job.events.get(), DISCONNECT_POLL_S)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        for job in jobs:
                            worker.cancel(job)
                        return JSONResponse(error_body("the client went away"), status_code=499)
                    continue
                if isinstance(item, Piece):
                    pieces += parts[index].push(item.text)
                    logprobs += item.logprobs
                    continue
                if isinstance(item, Failed):
                    for job in jobs:
                        worker.cancel(job)
                    kind = "invalid_request_error" if item.status == 400 else "server_error"
                    return JSONResponse(error_body(item.message, kind, code="timeout" if item.status == 504 else None), status_code=item.status)
                pieces += parts[index].finish()
                choices.append(reply.choice(index, pieces, parts[index].calls, item.finish_reason, logprobs))
                ends.append(item)
                break
        return JSONResponse(reply.whole(choices, usage_of(prompt_tokens, ends)))

    return app
