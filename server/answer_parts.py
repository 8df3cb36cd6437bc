"""A chat answer's text, split as it streams: the reasoning (`<think>...</think>`) apart from the
content, and the tool calls parsed out of it.

Tool calls come in the format the checkpoint's chat template teaches its model:
- "tagged": Qwen2.5's and Hermes' `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks, anywhere in the answer;
- "json": Llama 3's, an answer that is one JSON object `{"name": ..., "parameters": {...}}` (or a
  list of them).
Either way, an answer that is nothing but a call's JSON, bare or in a ```json fence, is a call too:
small models often write their call so.
Text that may begin a tag is held back until it is known not to; a tool call's text is held to the
end of the answer and parsed whole. Text that fails to parse as a call stays content: nothing the
model wrote is dropped.
"""

import json
import re
import uuid
from dataclasses import dataclass

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
JSON_FENCE = "```json"
TAGGED_CALL = re.compile(re.escape(TOOL_OPEN) + r"(.*?)(?:" + re.escape(TOOL_CLOSE) + r"|$)", re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (the OpenAI API's shape)
    id: str

    def as_api(self, index: int | None = None) -> dict:
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def tool_format(chat_template: str) -> str | None:
    """How the template's model writes tool calls; None: the template never shows it the tools."""
    if TOOL_OPEN in chat_template:
        return "tagged"
    return "json" if re.search(r"\btools\b", chat_template) else None


def as_call(text: str) -> list[ToolCall] | None:
    """The calls a JSON text holds ({"name", "arguments" or "parameters"}, or a list of them), or None."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    calls = []
    for item in value if isinstance(value, list) else [value]:
        arguments = item.get("arguments", item.get("parameters")) if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(item["name"], json.dumps(arguments, ensure_ascii=False), "call_" + uuid.uuid4().hex[:24]))
    return calls or None


def unfenced(text: str) -> str:
    """The text inside a ```json fence that is the whole answer, else the text."""
    inside = text.strip()
    if inside.startswith(JSON_FENCE) and inside.endswith("```"):
        return inside[len(JSON_FENCE) : -3]
    return inside


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of the text may be the start of the tag."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class AnswerParts:
    """thinking: the prompt already opened <think> (the answer starts inside the reasoning).
    tools: the tool-call format to parse ("tagged", "json"), or None when no tools were offered."""
    def __init__(self, thinking: bool, tools: str | None, split_reasoning: bool = True):
        """split_reasoning False: everything is content (a plain completion)."""
        self.state = "reasoning" if thinking else "start" if split_reasoning else "content"
        self.tools = tools
        self.pending = ""  # text not yet given out: it may begin a tag, or it is a tool call's
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> list[tuple[str, str]]:
        """The parts that are known now: ("reasoning" | "content", text) in order."""
        self.pending += text
        parts: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                begun = self.pending.lstrip()
                if begun.startswith(THINK_OPEN):
                    self.pending, self.state = begun[len(THINK_OPEN) :], "reasoning"
                elif self.tools and begun.startswith(("{", "[", JSON_FENCE)):
                    self.state = "json"
                elif not begun or THINK_OPEN.startswith(begun) or (self.tools and JSON_FENCE.startswith(begun)):
                    return parts  # too early to say
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                if THINK_CLOSE in self.pending:
                    reasoning, self.pending = self.pending.split(THINK_CLOSE, 1)
                    parts.append(("reasoning", reasoning))
                    self.state = "after_reasoning"
                    continue
                return self._give(parts, "reasoning", held_back(self.pending, THINK_CLOSE))
            elif self.state == "after_reasoning":  # the blank lines between reasoning and content are neither
                self.pending = self.pending.lstrip()
                if not self.pending:
                    return [part for part in parts if part[1]]
                self.state = "content"
            elif self.state == "content":
                if self.tools == "tagged" and TOOL_OPEN in self.pending:
                    content, rest = self.pending.split(TOOL_OPEN, 1)
                    parts.append(("content", content))
                    self.pending, self.state = TOOL_OPEN + rest, "calls"
                    return [part for part in parts if part[1]]
                return self._give(parts, "content", held_back(self.pending, TOOL_OPEN) if self.tools == "tagged" else 0)
            else:  # "calls" or "json": held whole until the end
                return [part for part in parts if part[1]]

    def _give(self, parts: list[tuple[str, str]], channel: str, keep: int) -> list[tuple[str, str]]:
        cut = len(self.pending) - keep
        parts.append((channel, self.pending[:cut]))
        self.pending = self.pending[cut:]
        return [part for part in parts if part[1]]

    def finish(self) -> list[tuple[str, str]]:
        """At the end of the answer: the parts left; the tool calls are in `calls`."""
        text, self.pending = self.pending, ""
        if self.state == "json":
            self.calls = as_call(unfenced(text)) or []
            return [] if self.calls else [("content", text)]
        if self.state == "calls":
            leftover = []
            for match in TAGGED_CALL.finditer(text):
                found = as_call(match.group(1).strip())
                self.calls += found or []
                if found is None:
                    leftover.append(match.group(0))
            leftover.append(TAGGED_CALL.sub("", text))
            content = "".join(leftover).strip()
            return [("content", content)] if content else []
        return [("reasoning" if self.state == "reasoning" else "content", text)] if text else []
