"""The OpenAI API's shapes: the requests serve.py accepts (pydantic checks their types and
ranges), the answers and stream chunks it sends, and its error bodies.

A field of the API that the engine does not implement (echo, best_of, ...) is refused with a 400
that names it, unless its value asks for nothing (null, false, 0, empty, the default), as the
OpenAI clients send it. A field the API does not define is refused too, at any depth of the body
(a message's, a tool's, a schema's): nothing a client sends is silently ignored.
"""

import json
import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.logit_rules import MOST_TOP_LOGPROBS, LogitRules, TokenLogprobs

MOST_CHOICES = 16  # n
KNOWN_FIELDS_ONLY = ConfigDict(extra="forbid")  # a field this server does not know is a 400 naming it, never ignored
from server.answer_parts import ToolCall
from server.logprobs import TokenText, chat_logprobs, completion_logprobs


class TextPart(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    type: Literal["text"]
    text: str


class CalledFunction(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    name: str
    arguments: str  # a JSON object, as text

    @model_validator(mode="after")
    def arguments_are_an_object(self) -> "CalledFunction":
        try:
            parsed = json.loads(self.arguments)
        except json.JSONDecodeError:
            parsed = None
        if not isinstance(parsed, dict):
            raise PydanticCustomError("arguments", f"tool call {self.name}: arguments must be a JSON object, as text")
        return self


class MessageToolCall(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class Message(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None  # the speaker's name, for templates that show it
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer: to which call
    reasoning_content: str | None = None  # an assistant's earlier reasoning, for templates that show it
    refusal: str | None = None  # an assistant's earlier refusal: its text, where content is null
    # What an earlier answer carries when a client sends it back as it came: nothing the template shows.
    annotations: list[dict] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def content_or_calls(self) -> "Message":
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.refusal)):
            raise PydanticCustomError("content", f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return self.refusal or ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)

    def for_template(self) -> dict:
        """As chat templates read a message: the calls' arguments as objects (Qwen's templates write them with tojson)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": json.loads(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


class Function(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema
    strict: bool | None = None


class Tool(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    type: Literal["function"]
    function: Function


class NamedToolChoice(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    type: Literal["function"]
    function: dict[str, str]

    @model_validator(mode="after")
    def names_a_function(self) -> "NamedToolChoice":
        if set(self.function) != {"name"}:
            raise PydanticCustomError("tool_choice", "tool_choice: a named choice is {\"type\": \"function\", \"function\": {\"name\": ...}}")
        return self


class JsonSchema(BaseModel):
    model_config = ConfigDict(populate_by_name=True, extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None  # enforced either way: the mask admits no other answer


class ResponseFormat(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def schema_with_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("json_schema", "response_format: json_schema is given with type json_schema, and only then")
        return self


class StreamOptions(BaseModel):
    model_config = KNOWN_FIELDS_ONLY

    include_usage: bool = False
    include_obfuscation: bool | None = None  # the stream is sent as it is, with no padding to hide its lengths

    @model_validator(mode="after")
    def no_obfuscation(self) -> "StreamOptions":
        if self.include_obfuscation:
            raise PydanticCustomError("not_implemented", "stream_options.include_obfuscation is not implemented by this server; drop it (or send false)")
        return self


# Fields of the API the engine does not implement, with the values that ask for nothing.
NOT_IMPLEMENTED = {
    "echo": (None, False),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "reasoning_effort": (None,),
    "verbosity": (None,),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "modalities": (None, ["text"]),
    "store": (None, False),
    "service_tier": (None, "auto", "default"),
}


class Sampling(BaseModel):
    """What both endpoints take: the length of the answer, how it is sampled, how it comes back."""

    model_config = KNOWN_FIELDS_ONLY

    model: str | None = None
    user: str | None = None  # who asks, for the caller's records; the answer does not depend on it
    metadata: dict[str, str] | None = None  # likewise
    safety_identifier: str | None = None  # likewise
    prompt_cache_key: str | None = None  # the prefix cache finds shared prompts by their tokens alone
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off (vLLM's clients send -1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0)
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[int, float] | None = None  # token id (a JSON key, so a string) -> added to its logit
    seed: int | None = None
    response_format: ResponseFormat | None = None
    n: int = Field(1, ge=1, le=MOST_CHOICES)  # answers to the prompt, sampled apart (its blocks shared)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def refuse_what_is_not_implemented(cls, body: object) -> object:
        """An answer would ignore these fields: refused, not ignored."""
        if isinstance(body, dict):
            for name, asks_nothing in NOT_IMPLEMENTED.items():
                if name in body and body[name] not in asks_nothing:
                    raise PydanticCustomError("not_implemented", f"{name} is not implemented by this server; drop it (or send {asks_nothing[-1]!r})")
        return body

    def stops(self) -> list[str]:
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return [stop for stop in stops if stop]

    def given_sampling(self) -> dict[str, float | int | None]:
        top_k = None if self.top_k is None else max(self.top_k, 0)
        return {"temperature": self.temperature, "top_k": top_k, "top_p": self.top_p, "min_p": self.min_p, "repetition_penalty": self.repetition_penalty}

    @model_validator(mode="after")
    def check_bias(self) -> "Sampling":
        for token, bias in (self.logit_bias or {}).items():
            if not -100 <= bias <= 100:
                raise PydanticCustomError("bias_range", f"logit_bias: the bias of token {token} must be in [-100, 100], got {bias}")
        return self

    def rules(self) -> LogitRules:
        bias = tuple((self.logit_bias or {}).items())
        return LogitRules(self.presence_penalty or 0.0, self.frequency_penalty or 0.0, bias, self.wanted_logprobs())

    def wanted_logprobs(self) -> int | None:
        """None: no log-probabilities; k: the sampled token's and the k likeliest."""
        raise NotImplementedError

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatRequest(Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MOST_TOP_LOGPROBS)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: one call at most, held by the grammar of a required or named call
    chat_template_kwargs: dict | None = None  # extra variables of the chat template (e.g. enable_thinking)

    @model_validator(mode="after")
    def top_logprobs_need_logprobs(self) -> "ChatRequest":
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("needs_logprobs", "top_logprobs needs logprobs: true")
        if self.tool_choice in ("auto", None) and self.tools and self.parallel_tool_calls is False:
            raise PydanticCustomError(
                "parallel_tool_calls", "parallel_tool_calls false is held only when the call is required: send tool_choice 'required' or a function by name, or drop it"
            )
        if self.tool_choice in ("auto", None):
            strict = [tool.function.name for tool in self.tools or [] if tool.function.strict]
            if strict:  # under 'auto' the model's calls are parsed from free text, not held to a grammar
                raise PydanticCustomError(
                    "strict", f"tools: strict function {strict[0]} is enforced only when the call is required: send tool_choice 'required' "
                    "or that function by name, or drop strict"
                )
        if self.tool_choice in ("none", "auto", None):
            return self
        names = [tool.function.name for tool in self.tools or []]
        if not names:
            raise PydanticCustomError("tool_choice", "tool_choice 'required' or a named function needs tools; send them, or tool_choice 'auto'")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function["name"] not in names:
            raise PydanticCustomError("tool_choice", f"tool_choice names function '{self.tool_choice.function['name']}', which is not among the tools ({', '.join(names)})")
        if self.response_format is not None and self.response_format.type != "text":
            raise PydanticCustomError("tool_choice", "tool_choice 'required' or a named function and response_format both shape the answer; send one of them")
        return self

    def forced_calls(self) -> tuple[bool, str | None, bool]:
        """Whether the answer must be tool calls, the one function it must call (None: any), and
        whether it makes one call only (a named function is called once)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function["name"], True
        return self.tool_choice == "required", None, self.parallel_tool_calls is False

    def offered_tools(self) -> list[dict] | None:
        """The tools the model is shown: none when tool_choice is 'none'."""
        if not self.tools or self.tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def wanted_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def answer_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Sampling):
    prompt: str | list[str] | list[int]  # text, a list of one text, or token ids
    logprobs: int | None = Field(None, ge=0, le=MOST_TOP_LOGPROBS)  # the sampled token's, and this many likeliest

    def wanted_logprobs(self) -> int | None:
        return self.logprobs

    def answer_limit(self) -> int | None:
        return self.max_tokens


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def usage_of(prompt_tokens: int, ends: list) -> dict:
    """The request's usage, from each answer's end (server.worker.Finished): its prompt counted once,
    and the most of it any answer found cached (the others share those blocks)."""
    return usage(prompt_tokens, sum(end.completion_tokens for end in ends), max(end.cached_tokens for end in ends))


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


class Reply:
    """The answer to one request, whole or as stream chunks, in the shape of its endpoint.
    token_text: how its log-probabilities' tokens are shown, if it asked for them (else None)."""

    def __init__(self, chat: bool, model: str, token_text: TokenText | None = None):
        self.chat, self.model, self.token_text = chat, model, token_text
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.sent: dict[int, int] = {}  # characters of each answer streamed so far (the completions' text_offset)

    def _head(self, kind: str) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model}

    def _logprobs(self, read: list[TokenLogprobs], offset: int) -> dict | None:
        if self.token_text is None:
            return None
        return chat_logprobs(read, self.token_text) if self.chat else completion_logprobs(read, self.token_text, offset)

    def choice(self, index: int, parts: list[tuple[str, str]], calls: list[ToolCall], finish_reason: str, read: list[TokenLogprobs]) -> dict:
        """One whole answer; parts: its ("reasoning" | "content", text) in order."""
        content = "".join(text for channel, text in parts if channel == "content")
        if not self.chat:
            return {"index": index, "text": content, "logprobs": self._logprobs(read, 0), "finish_reason": finish_reason}
        message = {"role": "assistant", "content": content if content or not calls else None}
        reasoning = "".join(text for channel, text in parts if channel == "reasoning")
        if reasoning:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = [call.as_api() for call in calls]
        return {"index": index, "message": message, "logprobs": self._logprobs(read, 0), "finish_reason": "tool_calls" if calls and finish_reason == "stop" else finish_reason}

    def whole(self, choices: list[dict], usage: dict) -> dict:
        return {**self._head("chat.completion" if self.chat else "text_completion"), "choices": choices, "usage": usage}

    def chunk(self, index: int, channel: str, text: str, read: list[TokenLogprobs] = ()) -> str:
        """One server-sent event: a piece of answer `index` ("content" or "reasoning"), and the
        log-probabilities of its tokens since its last event."""
        logprobs = self._logprobs(list(read), self.sent.get(index, 0)) if read else None
        if not self.chat:
            self.sent[index] = self.sent.get(index, 0) + len(text)
            return self._event({"index": index, "text": text, "logprobs": logprobs, "finish_reason": None})
        delta = {"reasoning_content" if channel == "reasoning" else "content": text}
        return self._event({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None})

    def first_chunk(self, index: int) -> str:
        if not self.chat:
            return self._event({"index": index, "text": "", "logprobs": None, "finish_reason": None})
        return self._event({"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None})

    def calls_chunk(self, index: int, calls: list[ToolCall]) -> str:
        return self._event({"index": index, "delta": {"tool_calls": [call.as_api(i) for i, call in enumerate(calls)]}, "logprobs": None, "finish_reason": None})

    def last_chunk(self, index: int, finish_reason: str, calls: list[ToolCall]) -> str:
        if not self.chat:
            return self._event({"index": index, "text": "", "logprobs": None, "finish_reason": finish_reason})
        return self._event({"index": index, "delta": {}, "logprobs": None, "finish_reason": "tool_calls" if calls and finish_reason == "stop" else finish_reason})

    def usage_chunk(self, usage: dict) -> str:
        return event({**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [], "usage": usage})

    def _event(self, choice: dict) -> str:
        return event({**self._head("chat.completion.chunk" if self.chat else "text_completion"), "choices": [choice]})


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


DONE = event("[DONE]")
