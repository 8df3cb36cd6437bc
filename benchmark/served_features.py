"""serve.py's structured output and tool calls on a real model, through the official openai client.

    python -m benchmark.served_features [--checkpoint DIR] [--answers-per-schema 10]

- json_schema: five schemas (objects, enums, bounded numbers, arrays of objects, a string
  pattern), each asked with several subjects at temperature 0.7; every answer is parsed and held
  to its schema by a hand-written check (no validator library). The mask's own cost per step
  (llguidance filling the next token's bitmask) is timed in this process over the answers' tokens.
- tools: a weather tool offered with tool_choice auto; the call parsed into tool_calls, its
  result sent back as a tool message, and the final answer, whole and streamed; then
  tool_choice required and a named function.

The default checkpoint is the packaged Qwen2.5-Coder-0.5B-Instruct (imported on first use).
"""

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from benchmark.load import ServerProcess
from benchmark.workload import progress
from errors import UserError, run_command
from weights.packaged import qwen_coder_checkpoint

SCHEMAS: list[tuple[str, dict, str, Callable[[dict], bool]]] = [
    (
        "person",
        {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 120}, "languages": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 4}}, "required": ["name", "age", "languages"], "additionalProperties": False},
        "Describe {} as a person record: name, age and the languages they speak.",
        lambda v: set(v) == {"name", "age", "languages"} and isinstance(v["name"], str) and isinstance(v["age"], int) and 0 <= v["age"] <= 120 and isinstance(v["languages"], list) and len(v["languages"]) <= 4 and all(isinstance(x, str) for x in v["languages"]),
    ),
    (
        "order",
        {"type": "object", "properties": {"item": {"enum": ["keyboard", "mouse", "monitor", "cable"]}, "quantity": {"type": "integer", "minimum": 1, "maximum": 99}, "express": {"type": "boolean"}}, "required": ["item", "quantity", "express"], "additionalProperties": False},
        "Turn this request into an order: {}",
        lambda v: set(v) == {"item", "quantity", "express"} and v["item"] in ("keyboard", "mouse", "monitor", "cable") and isinstance(v["quantity"], int) and 1 <= v["quantity"] <= 99 and isinstance(v["express"], bool),
    ),
    (
        "points",
        {"type": "object", "properties": {"points": {"type": "array", "minItems": 1, "maxItems": 4, "items": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}}, "required": ["x", "y"], "additionalProperties": False}}}, "required": ["points"], "additionalProperties": False},
        "Give up to four points on {} as x, y coordinates.",
        lambda v: set(v) == {"points"} and 1 <= len(v["points"]) <= 4 and all(set(p) == {"x", "y"} and all(isinstance(p[k], (int, float)) and not isinstance(p[k], bool) for k in "xy") for p in v["points"]),
    ),
    (
        "signature",
        {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,30}$"}, "args": {"type": "array", "items": {"type": "string", "pattern": "^[a-z_][a-z0-9_]{0,20}$"}, "maxItems": 5}, "returns": {"enum": ["int", "str", "bool", "list", "None"]}}, "required": ["name", "args", "returns"], "additionalProperties": False},
        "Write the signature of a Python function that would {}.",
        lambda v: set(v) == {"name", "args", "returns"} and re.fullmatch(r"[a-z_][a-z0-9_]{0,30}", v["name"]) is not None and len(v["args"]) <= 5 and all(re.fullmatch(r"[a-z_][a-z0-9_]{0,20}", a) for a in v["args"]) and v["returns"] in ("int", "str", "bool", "list", "None"),
    ),
    (
        "review",
        {"type": "object", "properties": {"title": {"type": "string", "maxLength": 60}, "rating": {"type": "number", "minimum": 0, "maximum": 5}, "pros": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 3}}, "required": ["title", "rating", "pros"], "additionalProperties": False},
        "Review {} in a few words.",
        lambda v: set(v) == {"title", "rating", "pros"} and isinstance(v["title"], str) and len(v["title"]) <= 60 and isinstance(v["rating"], (int, float)) and 0 <= v["rating"] <= 5 and len(v["pros"]) <= 3,
    ),
]
SUBJECTS = [
    ["Ada Lovelace", "a retired sailor from Oslo", "a student in Kyoto", "my neighbour Bob", "a chef in Lyon", "Alan Turing", "a nurse in Lagos", "a pilot", "a child of nine", "a poet in Lima"],
    ["two mice, fast", "one big monitor", "a cable, no hurry", "3 keyboards by tomorrow", "ten cables", "a mouse", "five monitors, express", "a keyboard for my son", "12 cables urgently", "one monitor and nothing else"],
    ["a circle of radius 1", "the line y = 2x", "a square", "the x axis", "a parabola", "a triangle", "the unit diagonal", "a spiral", "the y axis", "a small star"],
    ["reverse a string", "count vowels", "check if a number is prime", "merge two lists", "parse a date", "sum a list", "find the maximum", "flatten a nested list", "test for a palindrome", "return the length of a file"],
    ["a cheap laptop", "the film Alien", "a cup of coffee", "a bicycle", "a pair of shoes", "the Python language", "a hotel by the sea", "a board game", "a pizza place", "a text editor"],
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The local time in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def structured_answers(client, model: str, per_schema: int) -> tuple[list[dict], list[tuple[str, str]]]:
    """Every (schema, subject) answer: what came back and whether it holds; and the (schema name, text) pairs."""
    results, texts = [], []
    for (name, schema, prompt, check), subjects in zip(SCHEMAS, SUBJECTS):
        for i, subject in enumerate(subjects[:per_schema]):
            answer = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": prompt.format(subject)}], max_tokens=200, temperature=0.7, seed=i,
                response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}},
            )
            text = answer.choices[0].message.content
            try:
                holds = check(json.loads(text))
            except (json.JSONDecodeError, TypeError, KeyError, AttributeError):
                holds = False
            results.append({"schema": name, "subject": subject, "text": text, "finish_reason": answer.choices[0].finish_reason, "holds": holds})
            texts.append((name, text))
            progress(f"json_schema {name} / {subject}: {'holds' if holds else 'FAILS'}: {text}")
    return results, texts


def mask_cost(checkpoint: Path, texts: list[tuple[str, str]]) -> dict:
    """llguidance's bitmask fill per step, over the answers' own tokens (microseconds), and a schema's compile time (ms)."""
    from server.structured import JsonGrammars
    from weights.loader import read_config
    from weights.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(checkpoint)
    vocab_size = read_config(checkpoint).vocab_size
    grammars = JsonGrammars(checkpoint / "tokenizer.json", vocab_size, tokenizer.eos_ids)
    schemas = {name: schema for name, schema, _, _ in SCHEMAS}
    bitmask = torch.zeros(1, (vocab_size + 31) // 32, dtype=torch.int32)
    fills, compiles = [], []
    for name, text in texts:
        start = time.perf_counter()
        mask = grammars.mask("json_schema", schemas[name], False)
        compiles.append((time.perf_counter() - start) * 1e3)
        for token in tokenizer.encode(text, add_special_tokens=False):
            start = time.perf_counter()
            mask.fill(bitmask, 0)
            fills.append((time.perf_counter() - start) * 1e6)
            mask.accept(token)
    fills.sort()
    return {"fill_us_median": statistics.median(fills), "fill_us_p95": fills[int(0.95 * (len(fills) - 1))], "steps": len(fills), "compile_ms_median": statistics.median(compiles)}


def tool_round_trip(client, model: str) -> dict:
    """A call with tool_choice auto, its result sent back, the final answer whole and streamed; then required and named."""
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    first = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], max_tokens=100, temperature=0)
    choice = first.choices[0]
    calls = choice.message.tool_calls or []
    progress(f"tools, auto: finish_reason {choice.finish_reason}, calls {[(c.function.name, c.function.arguments) for c in calls]}, content {choice.message.content!r}")
    out: dict = {"auto_finish_reason": choice.finish_reason, "auto_calls": [(c.function.name, json.loads(c.function.arguments)) for c in calls]}
    if calls:
        messages += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": calls[0].id, "content": '{"temperature": 18, "unit": "celsius", "sky": "clear"}'}]
        for then in ("auto", "none"):  # 'none': the model is told of no tools, so it answers in words
            final = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=then, max_tokens=80, temperature=0)
            streamed = client.chat.completions.create(model=model, messages=messages, tools=[WEATHER, TIME], tool_choice=then, max_tokens=80, temperature=0, stream=True)
            chunks = list(streamed)
            out[f"final_{then}"] = {
                "answer": final.choices[0].message.content,
                "calls": [(c.function.name, c.function.arguments) for c in final.choices[0].message.tool_calls or []],
                "finish_reason": final.choices[0].finish_reason,
                "streamed_equals_whole": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (final.choices[0].message.content or ""),
            }
            progress(f"tools, final answer with tool_choice {then}: {out[f'final_{then}']}")
    for choice_name, tool_choice in (("required", "required"), ("named", {"type": "function", "function": {"name": "get_time"}})):
        forced = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Tell me about Rome."}], tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=100, temperature=0)
        got = [(c.function.name, json.loads(c.function.arguments)) for c in forced.choices[0].message.tool_calls or []]
        out[f"{choice_name}_calls"], out[f"{choice_name}_finish_reason"] = got, forced.choices[0].finish_reason
        progress(f"tools, {choice_name}: finish_reason {forced.choices[0].finish_reason}, calls {got}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", type=Path, help="model folder (default: the packaged Qwen2.5-Coder-0.5B-Instruct)")
    p.add_argument("--answers-per-schema", type=int, default=10, choices=range(0, 11), metavar="0-10", help="0: the tools alone")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args(argv)
    return run_command(lambda: measure(args.checkpoint or qwen_coder_checkpoint(), args.answers_per_schema, args.json))


def measure(checkpoint: Path, per_schema: int, out: Path | None) -> None:
    try:
        import openai  # the test extra's; the project itself never needs it
    except ImportError:
        raise UserError("this check drives serve.py with the official client: pip install openai") from None

    def command(port: int) -> list[str]:
        return [sys.executable, "serve.py", "--checkpoint", str(checkpoint), "--port", str(port), "--max-batch", "4"]

    progress(f"starting serve.py with {checkpoint}")
    server = ServerProcess(command, "/health")
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0, timeout=600)
        model = client.models.list().data[0].id
        results, texts = structured_answers(client, model, per_schema)
        tools = tool_round_trip(client, model)
    finally:
        server.stop()
    cost = mask_cost(checkpoint, texts) if texts else None
    if cost:
        print(f"json_schema: {sum(r['holds'] for r in results)} of {len(results)} answers parse and hold to their schema")
        print(f"mask per step: {cost['fill_us_median']:.0f} us median, {cost['fill_us_p95']:.0f} us p95 over {cost['steps']} steps; a schema compiles in {cost['compile_ms_median']:.1f} ms")
    print(f"tools: {json.dumps(tools)}")
    if out:
        out.write_text(json.dumps({"checkpoint": str(checkpoint), "json_schema": results, "mask_cost": cost, "tools": tools}, indent=1))


if __name__ == "__main__":
    sys.exit(main())
