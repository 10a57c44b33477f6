"""Tool-call parsers: a choice's output text, as it streams, turned into content and tool calls.

A parser is fed the text deltas of one choice and answers events: `Content` (text for `message.content`),
`CallStart` (a call's id and function name) and `Arguments` (a piece of a call's arguments JSON). The
non-streamed answer assembles the same events (`assemble`), so both shapes of a response say the same.

Parsers of `tool_choice: "auto"`, named as vLLM names them (`model.tool_call_parser`):
- `hermes`: calls as JSON objects `{"name": ..., "arguments": {...}}` inside `<tool_call>...</tool_call>` tags,
  text around them is content (Hermes, Qwen2.5/3 and the embedded model's shipped template). A list of such
  objects inside one pair of tags is several calls. A tag that does not hold a call stays content.
- `llama3_json`: an output that begins with `<|python_tag|>` or `{` is one or more JSON objects
  `{"name": ..., "parameters"|"arguments": {...}}` separated by `;` (Llama 3.1-3.3's JSON tool calling); any other
  output is content. An output that begins like a call but does not parse is content.
Constrained choices (deployments/api/tools.py): `required` parses the grammar's JSON array once the output ends;
a named function's output is its arguments, streamed as they are generated.

With `parallel_tool_calls: false` a reply keeps its first call only (vLLM's rule; "required"'s grammar allows one).
A call is sent once it is complete (its closing tag, or the output's end), except a named function's arguments,
which stream. Whitespace around calls is dropped (OpenAI's `content: null` beside tool calls); a reply without
calls keeps its text exactly.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from deployments.api.tools import ToolPlan

PARSERS = ("hermes", "llama3_json")


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int  # the call's place among the choice's calls
    id: str
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str  # a piece of the arguments' JSON text


Event = Content | CallStart | Arguments


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _calls_in(value) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call a parsed JSON value holds: an object with a string `name` and an object
    of `arguments` (or `parameters`), or a non-empty list of them; None if it holds none."""
    items = value if isinstance(value, list) and value else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls


def _json_calls(text: str) -> list[tuple[str, str]] | None:
    try:
        return _calls_in(json.loads(text))
    except ValueError:
        return None


@dataclass
class _Parser:
    """The events' bookkeeping every parser shares: call indices, and the whitespace around calls (dropped: a
    reply that calls tools has no blank content; a reply without calls keeps its text exactly)."""

    count: int = 0  # calls started
    single: bool = False  # at most one call: later ones are dropped (parallel_tool_calls: false)
    _held: str = ""  # content's trailing whitespace not sent yet: sent before more content, dropped at a call
    _after_call: bool = False  # the next content follows a call (its leading whitespace is dropped)

    def _content(self, text: str) -> list[Event]:
        text = self._held + text
        body = text.rstrip()  # trailing whitespace waits: dropped if a call comes next, sent if text does
        self._held = text[len(body):]
        if not body:
            return []
        if self._after_call:
            body, self._after_call = body.lstrip(), False
        return [Content(body)]

    def _calls(self, calls: list[tuple[str, str]]) -> list[Event]:
        events: list[Event] = []
        self._held, self._after_call = "", True
        for name, arguments in (calls[:max(0, 1 - self.count)] if self.single else calls):
            events += [CallStart(self.count, new_call_id(), name), Arguments(self.count, arguments)]
            self.count += 1
        return events

    def _end(self) -> list[Event]:
        """At the output's end: blank content still held is the reply's own text only when it called nothing."""
        held, self._held = self._held, ""
        return [Content(held)] if held and not self.count else []

    def feed(self, text: str) -> list[Event]:
        raise NotImplementedError

    def finish(self) -> list[Event]:
        raise NotImplementedError


@dataclass
class HermesParser(_Parser):
    OPEN = "<tool_call>"
    CLOSE = "</tool_call>"
    _buffer: str = ""
    _inside: bool = False  # after an opening tag whose closing tag has not come

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        events: list[Event] = []
        while True:
            if not self._inside:
                start = self._buffer.find(self.OPEN)
                if start < 0:  # send all but what may begin a tag
                    keep = _partial_suffix(self._buffer, self.OPEN)
                    events += self._content(self._buffer[:len(self._buffer) - keep])
                    self._buffer = self._buffer[len(self._buffer) - keep:]
                    return events
                events += self._content(self._buffer[:start])
                self._buffer, self._inside = self._buffer[start + len(self.OPEN):], True
            end = self._buffer.find(self.CLOSE)
            if end < 0:
                return events
            body, self._buffer, self._inside = self._buffer[:end], self._buffer[end + len(self.CLOSE):], False
            calls = _json_calls(body)
            events += self._calls(calls) if calls else self._content(self.OPEN + body + self.CLOSE)

    def finish(self) -> list[Event]:
        rest, self._buffer = self._buffer, ""
        if self._inside:  # the output ended inside a call (a stop at the closing tag, or the length limit)
            self._inside = False
            calls = _json_calls(rest)
            return (self._calls(calls) if calls else self._content(self.OPEN + rest)) + self._end()
        return self._content(rest) + self._end()


@dataclass
class Llama3JsonParser(_Parser):
    TAG = "<|python_tag|>"
    _buffer: str = ""
    _calling: bool | None = None  # None: undecided until the output's first non-blank characters

    def feed(self, text: str) -> list[Event]:
        if self._calling is False:
            return self._content(text)
        self._buffer += text
        if self._calling is None:
            head = self._buffer.lstrip()
            if not head or (len(head) < len(self.TAG) and self.TAG.startswith(head)):
                return []
            self._calling = head.startswith(self.TAG) or head.startswith("{")
            if not self._calling:
                text, self._buffer = self._buffer, ""
                return self._content(text)
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        if not self._calling:
            return self._content(text) + self._end()
        calls = _separated_objects(text.strip().removeprefix(self.TAG))
        return self._calls(calls) if calls else self._content(text) + self._end()


@dataclass
class RequiredParser(_Parser):
    """tool_choice "required": the grammar's array of `{"name", "parameters"}`, parsed once complete."""

    _buffer: str = ""

    def feed(self, text: str) -> list[Event]:
        self._buffer += text
        return []

    def finish(self) -> list[Event]:
        text, self._buffer = self._buffer, ""
        calls = _json_calls(text)  # cut short by max_tokens: the text as it is
        return self._calls(calls) if calls else self._content(text) + self._end()


@dataclass
class NamedParser(_Parser):
    """A named function: the output is the arguments, streamed as one call's arguments."""

    function: str = ""

    def feed(self, text: str) -> list[Event]:
        events: list[Event] = []
        if self.count == 0:
            events.append(CallStart(0, new_call_id(), self.function))
            self.count = 1
        return events + ([Arguments(0, text)] if text else [])

    def finish(self) -> list[Event]:
        return self.feed("") if self.count == 0 else []


def parser_for(plan: ToolPlan) -> _Parser:
    if plan.mode == "named":
        return NamedParser(function=plan.function or "")
    if plan.mode == "required":
        return RequiredParser(single=plan.single)
    if plan.parser == "hermes":
        return HermesParser(single=plan.single)
    if plan.parser == "llama3_json":
        return Llama3JsonParser(single=plan.single)
    raise ValueError(f"unknown tool-call parser {plan.parser!r}; one of {', '.join(PARSERS)}")


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (a tag that may be arriving)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _separated_objects(text: str) -> list[tuple[str, str]] | None:
    """The calls of JSON objects separated by `;` (and whitespace), or None if any part is not one."""
    decoder, calls, at = json.JSONDecoder(), [], 0
    while at < len(text):
        try:
            value, at = decoder.raw_decode(text, at)
        except ValueError:
            return None
        found = _calls_in(value)
        if found is None:
            return None
        calls += found
        at = len(text) - len(text[at:].lstrip().removeprefix(";").lstrip())
    return calls or None


@dataclass
class Assembled:
    """A choice's message once every event is in: content (None if blank) and its calls."""

    content: str | None = None
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, events: list[Event]) -> None:
        for event in events:
            if isinstance(event, Content):
                self.content = (self.content or "") + event.text
            elif isinstance(event, CallStart):
                self.tool_calls.append({"id": event.id, "type": "function",
                                        "function": {"name": event.name, "arguments": ""}})
            else:
                self.tool_calls[event.index]["function"]["arguments"] += event.text

    def message(self) -> dict:
        message = {"role": "assistant", "content": self.content or None}
        if self.tool_calls:
            message["tool_calls"] = self.tool_calls
        return message


def delta_of(events: list[Event]) -> dict | None:
    """One streamed chunk's `delta` for `events` (content, then tool-call pieces in OpenAI's chunk shape), or None
    when there is nothing to send."""
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: list[dict] = []
    for event in events:
        if isinstance(event, CallStart):
            calls.append({"index": event.index, "id": event.id, "type": "function",
                          "function": {"name": event.name, "arguments": ""}})
        elif isinstance(event, Arguments):
            if calls and calls[-1]["index"] == event.index:
                calls[-1]["function"]["arguments"] += event.text
            else:
                calls.append({"index": event.index, "function": {"arguments": event.text}})
    delta: dict = {}
    if content:
        delta["content"] = content
    if calls:
        delta["tool_calls"] = calls
    return delta or None


def finish_reason(reason: str | None, calls: int) -> str | None:
    """A choice that called tools and ended normally finishes with "tool_calls" (a length cut stays "length")."""
    return "tool_calls" if calls and reason == "stop" else reason
