"""Tool calls and reasoning in chat answers: the answer split into reasoning, content and calls
as it streams (every chunking of a hand-written answer gives the whole answer's parts), and the
tools, the tool messages and the template's variables rendered as transformers renders them."""

import json
import shutil
import signal

import pytest
import torch
import transformers

from server.answer_parts import AnswerParts, tool_format
from tests.test_serve import Server
from tests.tiny_tokenizer import write_tiny_tokenizer

# A ChatML template that shows tools (Hermes' style, as Qwen2.5's), written for these tests.
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "You may call these tools:\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\n"
    'Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>\n'
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' %}"
    "{%- elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n</tool_response><|im_end|>\n"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n{{ message.content }}"
    '{% for call in message.tool_calls %}<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n'
    "{%- else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{%- endif %}"
)
LLAMA_STYLE = "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}Respond with a JSON function call.{% endif %}"


def split(text: str, every: int) -> list[str]:
    return [text[i : i + every] for i in range(0, len(text), every)]


def parts_of(text: str, every: int, thinking: bool = False, tools: str | None = "tagged") -> tuple[dict, list, list]:
    """The text pushed in pieces of `every` characters: what came out per channel, the calls, and every piece given out."""
    parts = AnswerParts(thinking, tools)
    given = [part for piece in split(text, every) for part in parts.push(piece)] + parts.finish()
    joined = {channel: "".join(t for c, t in given if c == channel) for channel in ("reasoning", "content")}
    return joined, [(c.name, json.loads(c.arguments)) for c in parts.calls], given


@pytest.mark.parametrize("every", [1, 2, 5, 13, 1000])
def test_tagged_calls_are_parsed_out_and_never_streamed_as_content(every):
    answer = 'Let me look.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>{"name": "time", "arguments": {}}</tool_call>'
    joined, calls, given = parts_of(answer, every)
    assert joined == {"reasoning": "", "content": "Let me look."}
    assert calls == [("weather", {"city": "Paris"}), ("time", {})]
    assert not any("<" in text for _, text in given)


@pytest.mark.parametrize("every", [1, 4, 1000])
def test_reasoning_is_split_from_the_content(every):
    joined, calls, _ = parts_of("<think>Paris is in France.</think>\n\nIt is sunny.", every)
    assert joined == {"reasoning": "Paris is in France.", "content": "It is sunny."} and calls == []
    # The template opened <think> itself: the answer starts inside the reasoning.
    joined, _, _ = parts_of("Short plan.</think>Done.", every, thinking=True)
    assert joined == {"reasoning": "Short plan.", "content": "Done."}
    # An answer with no reasoning, that merely starts like a tag.
    assert parts_of("<thin ice", every)[0] == {"reasoning": "", "content": "<thin ice"}


def test_a_call_that_does_not_parse_stays_content_and_no_tools_means_no_calls():
    joined, calls, _ = parts_of("<tool_call>{not json}</tool_call> sorry", 3)
    assert calls == [] and joined["content"] == "<tool_call>{not json}</tool_call> sorry"
    joined, calls, _ = parts_of('<tool_call>{"name": "f", "arguments": {}}</tool_call>', 3, tools=None)
    assert calls == [] and joined["content"] == '<tool_call>{"name": "f", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("every", [1, 6, 1000])
def test_json_calls_as_llama_3_writes_them(every):
    assert parts_of('{"name": "weather", "parameters": {"city": "Oslo"}}', every, tools="json")[1] == [("weather", {"city": "Oslo"})]
    assert parts_of('{"answer": 42}', every, tools="json")[0]["content"] == '{"answer": 42}'
    assert parts_of("It is {warm}.", every, tools="json")[0]["content"] == "It is {warm}."


@pytest.mark.parametrize("every", [1, 3, 1000])
@pytest.mark.parametrize("tools", ["tagged", "json"])
def test_an_answer_that_is_only_a_call_is_a_call_bare_or_fenced(every, tools):
    fenced = '```json\n{\n  "name": "weather",\n  "arguments": {"city": "Paris"}\n}\n```'
    assert parts_of(fenced, every, tools=tools)[:2] == ({"reasoning": "", "content": ""}, [("weather", {"city": "Paris"})])
    assert parts_of('{"name": "weather", "arguments": {}}', every, tools=tools)[1] == [("weather", {})]
    for text in ('```json\n{"answer": 42}\n```', "```python\nprint(1)\n```", "``` not json"):  # not calls: content, whole
        joined, calls, _ = parts_of(text, every, tools=tools)
        assert calls == [] and joined["content"] == text


def test_the_call_format_follows_the_template():
    assert tool_format(TOOL_TEMPLATE) == "tagged" and tool_format(LLAMA_STYLE) == "json" and tool_format("{{ messages }}") is None


@pytest.fixture(scope="module")
def tool_server(chat_checkpoint, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tools")
    shutil.copytree(chat_checkpoint, folder, dirs_exist_ok=True)
    write_tiny_tokenizer(folder, TOOL_TEMPLATE)
    config = json.loads((folder / "config.json").read_text())  # room for the tools' system prompt and whole calls
    (folder / "config.json").write_text(json.dumps(config | {"max_position_embeddings": 1024}))
    server = Server(folder, "--no-compile", "--context", "1024", "--chat-template-kwargs", '{"enable_thinking": false}')
    server.wait_ready()
    yield server, folder
    server.stop()


TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]


def test_tools_and_tool_messages_are_rendered_as_transformers_renders_them(tool_server):
    server, folder = tool_server
    reference = transformers.AutoTokenizer.from_pretrained(folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny, 21 C"},
    ]
    as_transformers = [dict(m) for m in messages]
    as_transformers[2] = {**messages[2], "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}]}

    def prompt_tokens(body: dict) -> int:
        status, answer = server.post("/v1/chat/completions", {"messages": messages, "max_tokens": 3, **body})
        assert status == 200, answer
        return answer["usage"]["prompt_tokens"]

    def rendered(**kwargs) -> int:
        return len(reference.apply_chat_template(as_transformers, add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs)["input_ids"])

    assert prompt_tokens({"tools": TOOLS}) == rendered(tools=TOOLS, enable_thinking=False)
    assert prompt_tokens({"tools": TOOLS, "tool_choice": "none"}) == rendered(enable_thinking=False)  # 'none': the model is not shown them
    assert prompt_tokens({"chat_template_kwargs": {"enable_thinking": True}}) == rendered(enable_thinking=True)  # the request's over the server's
    assert prompt_tokens({}) == rendered(enable_thinking=False) < rendered(tools=TOOLS, enable_thinking=False)


class ScriptedWorker:
    """Stands in for the model's thread: every request is answered with the script's text, in
    pieces of a few characters, through the same events a real job gets."""

    state = "ready"

    def __init__(self, script: str):
        self.script = script

    def room(self, prompt_length: int) -> int:
        return 100

    def check(self, request) -> None:
        pass

    def stats(self) -> dict:
        return {"running": 0, "waiting": 0, "free_blocks": 1, "pool_blocks": 1}

    def cancel(self, job) -> None:
        pass

    def submit(self, job) -> None:
        from server.worker import Finished, Piece

        for piece in split(self.script, 3):
            job.send(Piece(piece, []))
        job.send(Finished("stop", len(job.request.prompt), 9, 0))


def scripted_client(folder, script: str):
    from fastapi.testclient import TestClient

    from server.app import Served, build_app
    from server.logprobs import TokenText
    from server.metrics import Metrics
    from server.structured import JsonGrammars
    from weights.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(folder)
    served = Served("tiny", tokenizer, None, 500, TokenText(folder / "tokenizer.json"), {}, JsonGrammars(folder / "tokenizer.json", 500, tokenizer.eos_ids))
    app = build_app(served, ScriptedWorker(script), Metrics("tiny"))
    import openai

    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=TestClient(app))


def test_calls_and_reasoning_reach_the_openai_client_whole_and_streamed(tool_server):
    _, folder = tool_server
    script = '<think>Need the weather.</think>\n\nChecking.<tool_call>\n{"name": "weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    client = scripted_client(folder, script)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    whole = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    assert choice.message.reasoning_content == "Need the weather."
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "weather" and json.loads(call.function.arguments) == {"city": "Paris"} and call.id.startswith("call_")

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, stream=True))
    deltas = [c.choices[0].delta for c in chunks]
    assert "".join(d.content or "" for d in deltas) == "Checking."
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Need the weather."
    [streamed] = [call for d in deltas for call in d.tool_calls or []]
    assert streamed.index == 0 and streamed.function.name == "weather" and json.loads(streamed.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # Without tools offered, the same text is content: nothing is parsed out of it, nothing lost.
    plain = client.chat.completions.create(model="tiny", messages=messages).choices[0]
    assert plain.finish_reason == "stop" and plain.message.tool_calls is None and "<tool_call>" in plain.message.content


def test_a_tokenizer_llguidance_cannot_read_costs_response_format_alone(tmp_path):
    from errors import UserError
    from server.structured import JsonGrammars

    (tmp_path / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
    grammars = JsonGrammars(tmp_path / "tokenizer.json", 500, frozenset({2}))
    assert grammars.mask("text", None, False) is None
    with pytest.raises(UserError, match="response_format is not available for this checkpoint"):
        grammars.mask("json_object", None, False)
    with pytest.raises(UserError, match="tool_choice is not available for this checkpoint"):
        grammars.tool_calls(TOOLS, None, False, "tagged", False)


# Tools whose calls a random model finishes within a few tokens: every argument is bounded.
BOUNDED_TOOLS = [
    {"type": "function", "function": {"name": "forecast", "parameters": {"type": "object", "properties": {"unit": {"enum": ["C", "F"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["unit", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {"utc": {"type": "boolean"}}, "required": ["utc"], "additionalProperties": False}}},
]


def test_tool_choice_required_and_named_hold_the_answer_to_calls(tool_server):
    server, folder = tool_server
    client = server.client()
    messages = [{"role": "user", "content": "What will the weather be?"}]
    names_seen, ends = set(), []
    for seed in range(4):
        for temperature in (0, 1.0):
            answer = client.chat.completions.create(model=folder.name, messages=messages, tools=BOUNDED_TOOLS, tool_choice="required", max_tokens=300, temperature=temperature, seed=seed)
            choice = answer.choices[0]
            ends.append(choice.finish_reason)
            assert choice.message.tool_calls
            if choice.finish_reason == "tool_calls":
                assert choice.message.content in (None, "")
            else:  # 'required' lets the model call again and again: the unfinished call is kept as text
                assert choice.finish_reason == "length" and choice.message.content.startswith("<tool_call>")
            for call in choice.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                names_seen.add(call.function.name)
                if call.function.name == "forecast":
                    assert arguments["unit"] in ("C", "F") and 1 <= arguments["days"] <= 7 and set(arguments) == {"unit", "days"}
                else:
                    assert call.function.name == "clock" and isinstance(arguments["utc"], bool) and set(arguments) == {"utc"}
    assert names_seen <= {"forecast", "clock"} and "tool_calls" in ends
    for seed in range(3):  # parallel_tool_calls false: one call, and the answer ends after it
        answer = client.chat.completions.create(model=folder.name, messages=messages, tools=BOUNDED_TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=300, temperature=1.0, seed=seed)
        assert answer.choices[0].finish_reason == "tool_calls" and len(answer.choices[0].message.tool_calls) == 1
    named = {"type": "function", "function": {"name": "clock"}}
    for stream in (False, True):
        created = client.chat.completions.create(model=folder.name, messages=messages, tools=BOUNDED_TOOLS, tool_choice=named, max_tokens=80, temperature=1.0, seed=5, stream=stream, n=2)
        if stream:
            calls = [call for chunk in created for call in chunk.choices[0].delta.tool_calls or []]
        else:
            calls = [call for choice in created.choices for call in choice.message.tool_calls]
        assert len(calls) == 2 and all(c.function.name == "clock" and set(json.loads(c.function.arguments)) == {"utc"} for c in calls)


@pytest.mark.parametrize(
    "body, message",
    [
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": BOUNDED_TOOLS, "parallel_tool_calls": False}, "parallel_tool_calls false is held only when the call is required"),
        ({"tools": BOUNDED_TOOLS, "tool_choice": {"type": "function", "function": {"name": "weather"}}}, "'weather', which is not among the tools (forecast, clock)"),
        ({"tools": BOUNDED_TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "send one of them"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array", "uniqueItems": True}}}], "tool_choice": "required"}, "uniqueItems"),
    ],
)
def test_a_tool_choice_that_cannot_be_held_is_a_400_naming_why(tool_server, body, message):
    server, _ = tool_server
    status, answer = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], **body})
    assert status == 400 and message in answer["error"]["message"], answer


@pytest.mark.parametrize("think_tokens", [True, False])
def test_a_grammar_waits_for_the_reasoning_to_close(tmp_path, think_tokens):
    """A prompt that opens <think>: the reasoning is free text, and the JSON comes after </think>,
    whether the tokenizer holds </think> as one token or spells it in pieces."""
    from server.structured import JsonGrammars
    from weights.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    if not think_tokens:
        spec = json.loads((tmp_path / "tokenizer.json").read_text())
        spec["added_tokens"] = [t for t in spec["added_tokens"] if "think" not in t["content"]]
        (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    tokenizer = Tokenizer.from_dir(tmp_path)
    grammars = JsonGrammars(tmp_path / "tokenizer.json", 500, tokenizer.eos_ids)

    def consumed(mask, text: str) -> bool:
        tokens = tokenizer.encode(text, add_special_tokens=False)
        return mask.matcher.try_consume_tokens(tokens) == len(tokens)

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert consumed(grammars.mask("json_schema", schema, True), 'Some plan, {with braces}.</think>\n\n{"a": 1}')
    assert not consumed(grammars.mask("json_schema", schema, True), "Some plan.</think>\n\nno JSON")
    assert not consumed(grammars.mask("json_schema", schema, False), 'Some plan.</think>{"a": 1}')
    assert consumed(grammars.mask("json_schema", schema, False), '{"a": 1}') and not consumed(grammars.mask("json_schema", schema, False), '{"a":1}')
    call = '<tool_call>\n{"name": "clock", "arguments": {"utc": true}}\n</tool_call>'
    for name, allowed in (("clock", True), ("forecast", True), ("weather", False)):  # 'required' chooses among the tools alone
        assert consumed(grammars.tool_calls(BOUNDED_TOOLS, None, False, "tagged", False), call.replace("clock", name).split(", ")[0] + ", ") == allowed
    assert consumed(grammars.tool_calls(BOUNDED_TOOLS, None, False, "tagged", True), "Which tool?</think>\n" + call + "\n" + call)
    assert not consumed(grammars.tool_calls(BOUNDED_TOOLS, "forecast", True, "tagged", False), call)
    once = grammars.tool_calls(BOUNDED_TOOLS, None, True, "tagged", False)  # parallel_tool_calls: false
    assert consumed(once, call) and not consumed(grammars.tool_calls(BOUNDED_TOOLS, None, True, "tagged", False), call + "\n" + call)


def test_a_complete_answer_may_end_with_any_of_the_checkpoints_end_tokens(tmp_path):
    """A chat model ends its turn with its own end token (Qwen's <|im_end|>), not only with the
    one llguidance knows: once the JSON is whole, the mask allows every EOS, and only then."""
    from server.structured import JsonGrammars
    from weights.tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    end_of_text, im_end = tokenizer.encode("<|endoftext|>", add_special_tokens=False)[0], tokenizer.encode("<|im_end|>", add_special_tokens=False)[0]
    sign_bit = 12 * 32 + 31  # an end token at bit 31 of its word, int32's sign bit
    mask = JsonGrammars(tmp_path / "tokenizer.json", 500, frozenset({end_of_text, im_end, sign_bit})).mask("json_object", None, False)
    bitmask = torch.zeros(1, 16, dtype=torch.int32)

    def allowed(token: int) -> bool:
        mask.fill(bitmask, 0)
        return bool((int(bitmask[0, token // 32]) >> (token % 32)) & 1)

    for token in tokenizer.encode('{"a": 1', add_special_tokens=False):
        assert not allowed(end_of_text) and not allowed(im_end)
        mask.accept(token)
    mask.accept(tokenizer.encode("}", add_special_tokens=False)[0])
    assert allowed(end_of_text) and allowed(im_end) and allowed(sign_bit)
    mask.accept(im_end)  # the row ends; the grammar is not asked about it


WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


@pytest.mark.real
def test_qwen_calls_a_tool_reads_its_result_and_holds_json_to_a_schema(packaged_model, tmp_path):
    """Qwen2.5-Coder through the official openai client, float32, temperature 0: the call parsed
    into tool_calls (whole and streamed), its result sent back as a tool message, a final answer
    in words (streamed the same), and json_schema answers that hold."""
    _, checkpoint = packaged_model("qwen-coder")
    server = Server(checkpoint, "--no-compile", "--dtype", "float32", "--max-batch", "2", log_dir=tmp_path)
    try:
        server.wait_ready()
        client, name = server.client(), checkpoint.name
        messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
        first = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0)
        [call] = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
        chunks = list(client.chat.completions.create(model=name, messages=messages, tools=[WEATHER], max_tokens=60, temperature=0, stream=True))
        [streamed] = [c for chunk in chunks for c in chunk.choices[0].delta.tool_calls or []]
        assert (streamed.function.name, json.loads(streamed.function.arguments)) == (call.function.name, json.loads(call.function.arguments))

        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 18 degrees Celsius."}]
        final = client.chat.completions.create(model=name, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=60, temperature=0)
        answer = final.choices[0].message
        assert answer.tool_calls is None and "18" in answer.content  # the tool's result reached the model
        chunks = list(client.chat.completions.create(model=name, messages=messages, tools=[WEATHER], tool_choice="none", max_tokens=60, temperature=0, stream=True))
        assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks) == answer.content

        schema = {"type": "object", "properties": {"item": {"enum": ["keyboard", "mouse"]}, "quantity": {"type": "integer", "minimum": 1}}, "required": ["item", "quantity"], "additionalProperties": False}
        form = {"type": "json_schema", "json_schema": {"name": "order", "schema": schema, "strict": True}}
        for request, item, quantity in (("two mice, please", "mouse", 2), ("one keyboard", "keyboard", 1)):
            order = client.chat.completions.create(model=name, messages=[{"role": "user", "content": f"Turn this into an order: {request}"}], response_format=form, max_tokens=40, temperature=0)
            assert json.loads(order.choices[0].message.content) == {"item": item, "quantity": quantity} and order.choices[0].finish_reason == "stop"
    finally:
        assert server.stop() == -signal.SIGTERM
