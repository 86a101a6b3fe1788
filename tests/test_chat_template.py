"""A chat template is code from a model file: it renders in a sandbox within a time and an
output budget, so a template that loops for ever or writes gigabytes is one line, not a
hang (real tiny GGUFs carrying each template)."""
from __future__ import annotations

import time

import pytest

import specee_cpp
from specee_cpp.engine.chat_template import TemplateBudget
from specee_cpp.errors import SpeceeError
from tiny_gguf import write_tiny_model

LOOP = ("{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}"
        "{{ messages[0]['content'] }}")
WIDE = "{% for a in range(100000) %}{{ 'x' * 100 }}{% endfor %}"
REPEAT = "{{ 'x' * 1000000000 }}"
POWER = "{{ 10 ** 100000000 }}"


# one C call each, which no time budget interrupts: refused from their arguments
ONE_CALL = {
    "method-pad": "{{ 'x'.ljust(1000000000) }}",
    "filter-center": "{{ 'x' | center(1000000000) }}",
    "filter-indent": "{{ ('a\n' * 100000) | indent(100000) }}",
    "percent-width": "{{ '%999999999s' % 'x' }}",
    "filter-format": "{{ '%999999999s' | format('x') }}",
    "method-format": "{{ '{:>999999999}'.format('x') }}",
    "item-format": "{{ '{:>999999999}'['format']('x') }}",
    "filter-replace": "{{ ('x' * 100000) | replace('', 'y' * 100000) }}",
    "method-replace": "{{ ('x' * 100000).replace('', 'y' * 100000) }}",
}


@pytest.mark.parametrize("template, words", [
    (LOOP, "ran past"), (WIDE, "wrote past"), (REPEAT, "repeats a value"),
    (POWER, "raises to the power"),
    *((t, "limit 8388608") for t in ONE_CALL.values()),
])
def test_a_template_past_its_budget_is_stopped_with_one_line(tmp_path, template, words):
    path = write_tiny_model(tmp_path / "t.gguf", chat_template=template)
    with specee_cpp.load(str(path)) as llm:
        t = time.perf_counter()
        with pytest.raises(TemplateBudget, match=words):
            llm.prompt_tokens("hi")
        assert time.perf_counter() - t < 10
        assert llm.prompt_tokens("hi", chat=False)   # raw prompts still work


def test_templates_within_budget_render_as_transformers_does(tmp_path):
    template = ("{% for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
                "[{{ m['role'] }}]{{ m['content'] | trim }}{{ m | tojson }}{% endfor %}"
                "{% generation %}{% endgeneration %}"
                "{% if add_generation_prompt %}[assistant]{% endif %}")
    path = write_tiny_model(tmp_path / "t.gguf", chat_template=template)
    with specee_cpp.load(str(path)) as llm:
        text = llm.prompt_text([{"role": "user", "content": " hi "}])
        assert text == '[user]hi{"role": "user", "content": " hi "}[assistant]'
    # the bounded calls, at sizes a template really uses
    small = ("{{ 'x'.ljust(3) }}|{{ 'x' | center(3) }}|{{ 'a\nb' | indent(2) }}|"
             "{{ '%3s' % 'x' }}|{{ '%2d' | format(5) }}|{{ '{:>3}'.format('x') }}|"
             "{{ 'ab' | replace('a', 'c') }}|{{ 'ab'.replace('b', 'd') }}")
    path = write_tiny_model(tmp_path / "s.gguf", chat_template=small)
    with specee_cpp.load(str(path)) as llm:
        assert llm.prompt_text("hi") == "x  | x |a\n  b|  x| 5|  x|cb|ad"
        bad = write_tiny_model(tmp_path / "b.gguf",
                               chat_template="{{ raise_exception('no system role') }}")
    with specee_cpp.load(str(bad)) as llm:
        with pytest.raises(SpeceeError, match="chat template failed: no system role"):
            llm.prompt_text("hi")
