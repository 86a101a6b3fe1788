"""Chat prompts rendered with the model's own template (the GGUF's tokenizer.chat_template)."""
from __future__ import annotations

from ..bindings import Model
from ..errors import SpeceeError

_ROLES = {"system", "user", "assistant", "tool"}


class ChatTemplate:
    def __init__(self, model: Model):
        template = model.chat_template
        if not template:
            raise SpeceeError(f"{model.path.name} has no chat template; use raw prompts (--raw)")
        # llama-cpp-python's formatter mirrors Transformers' Jinja environment (sandbox,
        # loop controls, tojson, strftime_now), which these templates are written for.
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        try:
            self._fmt = Jinja2ChatFormatter(template, eos_token=model.token_text(model.eos),
                                            bos_token=model.token_text(model.bos))
        except Exception as e:  # jinja2's TemplateSyntaxError and friends
            raise SpeceeError(f"the chat template of {model.path.name} does not compile ({e}); "
                              f"use raw prompts (--raw)") from None

    def render(self, messages: list[dict]) -> str:
        for m in messages:
            if not isinstance(m, dict) or m.get("role") not in _ROLES or "content" not in m:
                raise SpeceeError(f"bad chat message {m!r}: need role in {sorted(_ROLES)} "
                                  f"and content")
        try:
            return self._fmt(messages=messages).prompt
        except Exception as e:  # template errors (raise_exception, undefined vars)
            raise SpeceeError(f"chat template failed: {e}") from None
