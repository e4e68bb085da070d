"""Chat templates (sandboxed jinja2, as HF renders them) and chat tokens with an assistant loss mask."""

from __future__ import annotations

import json
import re
from bisect import bisect_left, bisect_right
from collections.abc import Collection, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import TYPE_CHECKING, Any

from jinja2 import Template, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

if TYPE_CHECKING:
    from model.tokenizer import GGUFTokenizer

DEFAULT_ROLES = frozenset({"system", "user", "assistant", "tool"})

# Private-use code points that mark message contents in a second render: OPEN index SEP content CLOSE.
_OPEN, _SEP, _CLOSE = "\ue000", "\ue001", "\ue002"
_MARKED = re.compile(f"{_OPEN}(\\d+){_SEP}(.*?){_CLOSE}", re.DOTALL)


class _GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}` (HF's assistant-mask tag): renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@lru_cache(maxsize=16)
def _compile(template: str) -> Template:
    return _environment().from_string(template)


def check_messages(messages: Sequence[Mapping[str, Any]], roles: Collection[str] = DEFAULT_ROLES) -> None:
    """Raise ValueError naming the message and field unless every message has a known role and str content."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role', 'content'}} dicts, got {type(messages).__name__}")
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise ValueError(f"messages[{i}] must be a dict, got {type(msg).__name__}")
        for field in ("role", "content"):
            if field not in msg:
                raise ValueError(f"messages[{i}] has no '{field}'")
            if not isinstance(msg[field], str):
                raise ValueError(f"messages[{i}].{field} must be a string, got {type(msg[field]).__name__}")
        if msg["role"] not in roles:
            raise ValueError(f"messages[{i}].role={msg['role']!r} is not one of {sorted(roles)}")


def render_chat(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool = False,
    bos_token: str = "",
    eos_token: str = "",
    **context: Any,
) -> str:
    """Render `messages` with a HF/GGUF chat template (tokenizer.chat_template) in a jinja2 sandbox."""
    return _compile(template).render(
        messages=messages,
        add_generation_prompt=add_generation_prompt,
        bos_token=bos_token,
        eos_token=eos_token,
        **context,
    )


def _marked(index: int, content: str, space_outside: bool) -> str:
    """`content` wrapped in markers; space_outside: its leading and trailing whitespace left outside them, where a
    template's `| trim` still removes it (the markers would otherwise shield it)."""
    if not space_outside:
        return f"{_OPEN}{index}{_SEP}{content}{_CLOSE}"
    core = content.strip()
    lead = content[: len(content) - len(content.lstrip())]
    return f"{lead}{_OPEN}{index}{_SEP}{core}{_CLOSE}{content[len(lead) + len(core) :]}"


def _marked_spans(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    text: str,
    context: Mapping[str, Any],
    space_outside: bool = False,
) -> list[tuple[int, int]] | None:
    """Span of each message's content in `text`, from a render whose contents are wrapped in markers.

    space_outside: the markers hold each content without its surrounding whitespace, so a template that trims some
    contents (Gemma's turns, not its folded system message) renders the same text; the spans are then the trimmed
    contents. None when the template changes the marked contents (so the render with the markers taken out is not
    `text`).
    """
    if any(c in m["content"] for m in messages for c in (_OPEN, _SEP, _CLOSE)):
        return None
    marked = [{**m, "content": _marked(i, m["content"], space_outside)} for i, m in enumerate(messages)]
    try:
        rendered = render_chat(template, marked, **context)
    except Exception:  # the template inspected the content: fall back to searching
        return None
    spans: dict[int, tuple[int, int]] = {}
    plain: list[str] = []
    pos = removed = 0
    for match in _MARKED.finditer(rendered):
        index = int(match.group(1))
        if index in spans or index >= len(messages):
            return None
        plain.append(rendered[pos : match.start()])
        start = match.start() - removed
        spans[index] = (start, start + len(match.group(2)))
        plain.append(match.group(2))
        removed += len(match.group(0)) - len(match.group(2))
        pos = match.end()
    plain.append(rendered[pos:])
    if "".join(plain) != text:
        return None
    for i, msg in enumerate(messages):
        if i not in spans:
            raise ValueError(
                f"messages[{i}] (role {msg['role']!r}) does not appear in the rendered chat: "
                "its role is unknown to the chat template"
            )
    return [spans[i] for i in range(len(messages))]


def _searched_spans(messages: Sequence[Mapping[str, Any]], text: str) -> list[tuple[int, int]]:
    """Span of each message's content found in order in `text` (as is, or stripped)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, msg in enumerate(messages):
        for content in (msg["content"], msg["content"].strip()):
            start = text.find(content, cursor)
            if start >= 0:
                break
        else:
            raise ValueError(
                f"messages[{i}] (role {msg['role']!r}): its content is not in the rendered chat "
                "(role unknown to the chat template?)"
            )
        cursor = start + len(content)
        spans.append((start, cursor))
    return spans


def content_spans(
    template: str, messages: Sequence[Mapping[str, Any]], text: str, **context: Any
) -> list[tuple[int, int]]:
    """[start, end) character span of each message's content in `text` = render_chat(template, messages)."""
    return (
        _marked_spans(template, messages, text, context)
        or _marked_spans(template, messages, text, context, space_outside=True)
        or _searched_spans(messages, text)
    )


def tokenize_chat(
    tokenizer: GGUFTokenizer,
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = False,
    train_roles: Collection[str] = ("assistant",),
    roles: Collection[str] = DEFAULT_ROLES,
) -> tuple[list[int], list[int]]:
    """Token ids of the rendered chat and a loss mask: 1 on tokens of `train_roles` contents, 0 elsewhere.

    A token is masked when it overlaps the content. The end-of-turn special token that closes a trained
    message (e.g. <|im_end|>, <|eot_id|>) is masked too, with any whitespace-only tokens between them; what
    follows it (a newline, the next header) is not.
    """
    check_messages(messages, roles)
    context = {
        "add_generation_prompt": add_generation_prompt,
        "bos_token": tokenizer.bos_token or "",
        "eos_token": tokenizer.eos_token or "",
    }
    text = render_chat(template, messages, **context)
    spans = content_spans(template, messages, text, **context)
    ids, offsets = tokenizer.encode_offsets(text)
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    mask = [0] * len(ids)
    for msg, (start, end) in zip(messages, spans, strict=True):
        if msg["role"] not in train_roles:
            continue
        first = bisect_right(ends, start)  # first token ending after the content starts
        stop = bisect_left(starts, end) if end > start else first  # first token starting at/after its end
        for k in range(first, stop):
            mask[k] = 1
        pending = []
        for k in range(stop, len(ids)):
            if ids[k] in tokenizer.special_ids:
                for j in (*pending, k):
                    mask[j] = 1
                break
            if not text[starts[k] : ends[k]].isspace():
                break
            pending.append(k)
    return ids, mask
