"""Chat prompts rendered with the model's own template (the GGUF's tokenizer.chat_template).

A template is code from a model file: it runs in Jinja's immutable sandbox, as Transformers
runs it, and within a budget (``TEMPLATE_RENDER_S`` seconds, ``TEMPLATE_MAX_CHARS`` of
output), so that a template that loops for ever or writes gigabytes is refused with one line
instead of hanging the process or the server.
"""
from __future__ import annotations

import operator
import sys
import time

from ..bindings import Model
from ..config import TEMPLATE_MAX_CHARS, TEMPLATE_RENDER_S
from ..errors import SpeceeError

_ROLES = {"system", "user", "assistant", "tool"}


class TemplateBudget(SpeceeError):
    """A chat template ran past its time or output budget."""


def _environment(max_chars: int):
    """Transformers' chat-template environment (the sandbox, loop controls, generation
    tags ignored, tojson), with the ways to make a huge string in one C call refused, which
    the time budget cannot interrupt: ``*`` and ``**``, padding and centring to a width, a
    format with a width (``'%999999999s' % x``), replacing "" with a long string, each past
    the output budget. A real template never asks for one so large."""
    import re

    from jinja2 import BaseLoader, ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    wide = re.compile(r"\d{%d,}" % len(str(max_chars)))   # a width as long as the budget

    def refuse(what: str) -> TemplateBudget:
        return TemplateBudget(f"chat template {what} (limit {max_chars} characters)")

    def check_width(fmt) -> None:
        if isinstance(fmt, str) and wide.search(fmt):
            raise refuse(f"formats with a width in {fmt[:40]!r}")

    def check_size(what: str, n) -> None:
        if isinstance(n, int) and n > max_chars:
            raise refuse(f"{what} to {n}")

    def check_replace(text, old, new) -> None:
        if isinstance(text, str) and old == "" and isinstance(new, str):
            check_size("replaces '' with a string", (len(text) + 1) * len(new))

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator_name, left, right):
            if operator_name == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple)) and isinstance(b, int):
                        check_size("repeats a value", len(a) * b)
                return operator.mul(left, right)
            if operator_name == "%":
                check_width(left)
                return operator.mod(left, right)
            if isinstance(right, int) and abs(right) > 4096:
                raise refuse(f"raises to the power {right}")
            return operator.pow(left, right)

        def getattr(self, obj, attribute):
            # the sandbox hands out str.format as its own function, without the string
            if isinstance(obj, str) and attribute in ("format", "format_map"):
                check_width(obj)
            return super().getattr(obj, attribute)

        def getitem(self, obj, argument):
            if isinstance(obj, str) and argument in ("format", "format_map"):
                check_width(obj)
            return super().getitem(obj, argument)

        def call(self, context, obj, *args, **kwargs):
            # a string's own methods: str.ljust(10**9) and friends
            if isinstance(getattr(obj, "__self__", None), str):
                name = getattr(obj, "__name__", "")
                if name in ("ljust", "rjust", "center", "zfill") and args:
                    check_size("pads a string", args[0])
                elif name == "expandtabs":
                    check_size("expands tabs", obj.__self__.count("\t") * (args[0] if args
                                                                            else 8))
                elif name == "replace" and len(args) >= 2:
                    check_replace(obj.__self__, args[0], args[1])
            return super().call(context, obj, *args, **kwargs)

    env = Bounded(loader=BaseLoader(), trim_blocks=True, lstrip_blocks=True,
                  extensions=[Jinja2ChatFormatter.IgnoreGenerationTags, ext.loopcontrols])
    env.filters["tojson"] = Jinja2ChatFormatter.tojson
    center, indent, fmt, replace = (env.filters[k] for k in ("center", "indent", "format",
                                                              "replace"))

    def center_(value, width=80):
        check_size("centres a string", width)
        return center(value, width)

    def indent_(s, width=4, *args, **kwargs):
        if isinstance(width, int):
            check_size("indents", width * (str(s).count("\n") + 1))
        return indent(s, width, *args, **kwargs)

    def format_(value, *args, **kwargs):
        check_width(value)
        return fmt(value, *args, **kwargs)

    def replace_(eval_ctx, s, old, new, count=None):
        check_replace(str(s), old, new)
        return replace(eval_ctx, s, old, new, count)

    replace_.jinja_pass_arg = replace.jinja_pass_arg   # it takes the evaluation context
    env.filters.update(center=center_, indent=indent_, format=format_, replace=replace_)
    env.globals["strftime_now"] = Jinja2ChatFormatter.strftime_now
    return env


def _raise_exception(message: str):
    raise ValueError(message)


class ChatTemplate:
    def __init__(self, model: Model, seconds: float = TEMPLATE_RENDER_S,
                 max_chars: int = TEMPLATE_MAX_CHARS):
        template = model.chat_template
        if not template:
            raise SpeceeError(f"{model.path.name} has no chat template; use raw prompts (--raw)")
        self.name, self.seconds, self.max_chars = model.path.name, seconds, max_chars
        self._eos, self._bos = model.token_text(model.eos), model.token_text(model.bos)
        try:
            self._template = _environment(max_chars).from_string(template)
        except Exception as e:  # jinja2's TemplateSyntaxError and friends
            raise SpeceeError(f"the chat template of {self.name} does not compile ({e}); "
                              f"use raw prompts (--raw)") from None

    def render(self, messages: list[dict]) -> str:
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or "content" not in m:
                raise SpeceeError(f"bad chat message {m!r}: need role in {sorted(_ROLES)} "
                                  f"and content")
        try:
            return self._bounded(messages=messages, eos_token=self._eos, bos_token=self._bos,
                                 raise_exception=_raise_exception, add_generation_prompt=True,
                                 functions=None, function_call=None, tools=None,
                                 tool_choice=None)
        except TemplateBudget as e:
            raise TemplateBudget(f"the chat template of {self.name} was stopped: {e}; use raw "
                                 f"prompts (--raw)") from None
        except Exception as e:  # template errors (raise_exception, undefined vars)
            raise SpeceeError(f"chat template failed: {e}") from None

    def _bounded(self, **context) -> str:
        """Render piece by piece, counting the output, with a trace function that stops the
        template's Python (Jinja compiles to it) once its time is up. The trace is this
        thread's alone and the one in place before (a debugger's) is put back."""
        deadline = time.perf_counter() + self.seconds

        def trace(frame, event, arg):
            if time.perf_counter() > deadline:
                raise TemplateBudget(f"it ran past {self.seconds:g} s")
            return trace

        out, n = [], 0
        before = sys.gettrace()
        sys.settrace(trace)
        try:
            for piece in self._template.generate(**context):
                n += len(piece)
                if n > self.max_chars:
                    raise TemplateBudget(f"it wrote past {self.max_chars} characters")
                out.append(piece)
        finally:
            sys.settrace(before)
        return "".join(out)
