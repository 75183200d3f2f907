"""A tokenizer's Jinja chat template, compiled once and rendered the way transformers renders it.

Owns the sandboxed Jinja environment (`trim_blocks`, `lstrip_blocks`, loop controls, and the
names hub templates call: `raise_exception`, `strftime_now`, transformers' `tojson`), the
`{% generation %}` tag, and turning every template error into one line that names the file the
template came from and the template's line.

`{% generation %}...{% endgeneration %}` is how transformers' templates mark what the assistant
says: the body renders unchanged, and its character span in the output is recorded
(`ChatText.assistant_spans`), from which a token mask follows (`token_mask`, what transformers
returns as `assistant_masks`). The span is where the body lands in the output streamed so far,
so a tag inside a macro or a `{% set %}` block, whose output is not streamed where it is made,
records no true span; transformers measures it the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

SPANS = "__rlfusion_generation_spans"  # the render variable the generation tag records into


@dataclass(frozen=True)
class ChatText:
    """A rendered chat: its text and the `[start, end)` character spans of its
    `{% generation %}` bodies (the assistant's text)."""

    text: str
    assistant_spans: tuple[tuple[int, int], ...] = ()

    def strip_prefix(self, prefix: str | None) -> ChatText:
        """This chat without a leading `prefix` (e.g. the BOS string), spans shifted with it."""
        if not prefix or not self.text.startswith(prefix):
            return self
        n = len(prefix)
        return ChatText(self.text[n:], tuple((max(a - n, 0), max(b - n, 0)) for a, b in self.assistant_spans))


class _Spans:
    """What the generation tag records into during one render: the characters streamed so far,
    and the span of each tag's body."""

    def __init__(self) -> None:
        self.emitted = 0
        self.spans: list[tuple[int, int]] = []


def token_mask(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[int]:
    """1 for each token (`offsets`: its character span) that overlaps an assistant span."""
    return [int(any(start < end_s and end > start_s for start_s, end_s in spans))
            for start, end in offsets]


class TemplateFault(Exception):
    """`raise_exception(...)` called by a template (named with its line like any other fault)."""


class ChatTemplate:
    """`source` compiled; `where` (the file it came from) and the template line are named by
    every error, at compile time and at render time."""

    def __init__(self, source: str, where: str):
        import jinja2

        self.source, self.where = source, where
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as e:  # syntax errors, unknown tags, unclosed blocks
            raise ValueError(self._fault(e)) from None

    def render(self, messages: list[dict], add_generation_prompt: bool, **variables) -> ChatText:
        """The text of `messages` and where the assistant's parts lie in it."""
        spans, parts = _Spans(), []
        try:
            for part in self._template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                **variables, **{SPANS: spans}):
                parts.append(part)
                spans.emitted += len(part)
        except Exception as e:  # any fault inside a template: jinja's, a Python one, raise_exception
            raise ValueError(self._fault(e)) from None
        return ChatText("".join(parts), tuple(spans.spans))

    def _fault(self, e: Exception) -> str:
        """One line: the file, the template line where known, and what went wrong."""
        line = _template_line(e)
        what = " ".join(str(e).split())
        what = f"raise_exception: {what}" if isinstance(e, TemplateFault) else f"{type(e).__name__}: {what}"
        where = self.where if self.where.endswith(".jinja") else f"{self.where}: chat_template"
        return f"{where} line {line}: {what}" if line is not None else f"{where}: {what}"


def _template_line(e: Exception) -> int | None:
    """The template line of a fault: a syntax error carries it; a render error's traceback has
    frames that jinja rewrote to the template's own lines (filename `<template>`)."""
    line = getattr(e, "lineno", None)
    tb = e.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _environment():
    """A sandboxed environment with what hub templates use; a template is untrusted code."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_record", [jinja2.nodes.Name(SPANS, "load")]),
                                          [], [], body).set_lineno(lineno)

        def _record(self, spans: _Spans, caller) -> str:
            body = caller()
            if isinstance(spans, _Spans):  # the body lands right after what was streamed so far
                spans.spans.append((spans.emitted, spans.emitted + len(body)))
            return body

    def raise_exception(message):
        raise TemplateFault(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # transformers' filter: no HTML escaping, keys in their order (jinja's own escapes and sorts)
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env
