#!/usr/bin/env python3
"""How often each draft variant's greedy token is the target's, per category (teacher-forced).

For dev prompts (Spec-Bench, `--per-category` per category outside the calibration pool,
cut to `--max-prompt-tokens`), the target's greedy answer is generated here; or the prompts
and `plain` answers of bench runs are read back (`--records`, and `--code-records` for a
HumanEval run, whose tasks join the table). Then each draft variant reads prompt + answer
in one batch and its greedy token after every answer position is compared with the
target's. That is the acceptance of
a draft of length 1 with none of the round structure: an upper bound of what the draft can
reach there, cheap to take for many variants on many prompts. A reduced head (`:vN`) can
never propose a token it has no row for; the table also gives the share of the target's
tokens its head holds, and the agreement where the target is sure (top-1 >= 0.99), where
every full-head draft agrees with it.

    python scripts/draft_agreement.py --variants Q4_K_M,IQ4_NL,IQ4_NL:v16k,IQ4_NL:v32k \\
        --records docs/bench/first-turns-6-icelake-xeon-prompt-read.jsonl \\
        --code-records docs/bench/humaneval-icelake-xeon-prompt-read.jsonl
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict

import numpy as np

SURE = 0.99


def read_answer(seq, prompt: list[int], answer: list[int]) -> list[int]:
    """Teacher-forced: ``seq`` reads prompt + answer from an empty cache, all outputs kept
    for the answer's positions; its greedy token after each one (read in C)."""
    seq.decode(prompt[:-1])
    return seq.decode_greedy(prompt[-1:] + answer)[:len(answer)]


def answers_from(records: str) -> dict[str, str]:
    """prompt id -> the plain configuration's text in a bench run's records (repeat 0)."""
    out = {}
    with open(records, encoding="utf-8") as f:
        for line in f:
            r = json.loads(line)
            if r["config"] == "plain" and r.get("repeat", 0) == 0 and r.get("turn", 1) == 1:
                out[r["prompt_id"]] = r["text"]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variants", default="Q4_K_M,IQ4_NL,IQ4_NL:v16k,IQ4_NL:v32k",
                    help="variants of --draft (TYPE, vN, TYPE:vN) or .gguf paths")
    ap.add_argument("--records", help="a first-turn bench run's records: its plain answers")
    ap.add_argument("--code-records", help="a HumanEval bench run's records: its plain answers")
    ap.add_argument("--per-category", type=int, default=6)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ns = ap.parse_args()

    from specee_cpp.bench.prompts import (DEV_PROMPTS, fitting_pool, load, load_spec_bench,
                                          per_category)
    from specee_cpp.bench.suite import shorten
    from specee_cpp.engine.llm import load as load_model

    log = lambda m: print(f"[agreement] {m}", file=sys.stderr, flush=True)  # noqa: E731
    given = answers_from(ns.records) if ns.records else {}
    if ns.code_records:
        given.update(answers_from(ns.code_records))
    # the prompts: those of the records, else the bench's own dev selection
    dev = load_spec_bench(DEV_PROMPTS)
    if given:
        prompts = [p for p in dev if p.id in given]
        he = sorted(int(i.split("/")[1]) for i in given if i.startswith("HumanEval/"))
        if he:
            prompts += [p for p in load(f"humaneval:{he[0]}-{he[-1]}") if p.id in given]
    else:
        prompts = per_category(dev, ns.per_category, {p.id for p in fitting_pool(dev, 64)})
    data = []
    with load_model(ns.target) as llm:
        seq = llm.tgt.seq
        for k, p in enumerate(prompts):
            p = shorten(p, llm.model, ns.max_prompt_tokens)
            pt = llm.prompt_tokens(p.text, chat=p.chat)
            if p.id in given:
                ans = llm.model.tokenize(given[p.id], add_special=False)
            else:
                ans = llm.generate(p.text, chat=p.chat, max_tokens=ns.max_tokens,
                                   stop=p.stop).tokens
            llm.reset()
            read_answer(seq, pt, ans)
            conf = [seq.confidence(j) for j in range(len(ans))]
            # the target's own greedy token after each position (= the answer where it was
            # generated here; a re-tokenized text may differ at a few places)
            data.append((p.category, pt, ans, [c[0] for c in conf], [c[1] for c in conf]))
            log(f"target {k + 1}/{len(prompts)}")
    rows = []
    for v in ns.variants.split(","):
        spec = v if v.endswith(".gguf") else f"{ns.draft}:{v}"   # a variant, or a file
        with load_model(spec) as d:
            s, head = d.tgt.seq, d.model.n_head
            by_cat, sure, held = defaultdict(list), [], []
            for cat, pt, ans, tgt, top1 in data:
                d.reset()
                guess = read_answer(s, pt, ans)
                for j, (t, p1) in enumerate(zip(tgt, top1)):
                    ok = guess[j] == t
                    by_cat[cat].append(ok)
                    if p1 >= SURE:
                        sure.append(ok)
                    # a reduced head's -inf logit: a token it cannot propose
                    held.append(not head or bool(np.isfinite(s.logits(j)[t])))
        allv = [x for xs in by_cat.values() for x in xs]
        rows.append((v, head or d.model.n_vocab, {c: float(np.mean(x)) for c, x in by_cat.items()},
                     float(np.mean(allv)), float(np.mean(sure)), float(np.mean(held))))
        log(f"{spec}: {rows[-1][3]:.3f}")
    cats = sorted({c for c, *_ in data})
    n_tok = defaultdict(int)
    for c, _, ans, *_ in data:
        n_tok[c] += len(ans)
    print(f"`python scripts/draft_agreement.py {' '.join(sys.argv[1:])}`\n")
    print("| variant | head rows | " + " | ".join(f"{c} ({n_tok[c]})" for c in cats)
          + " | all | target sure (top-1 >= 0.99) | target tokens in the head |")
    print("|---|---|" + "---|" * (len(cats) + 3))
    for v, head, by, allv, sure, held in rows:
        print(f"| {v} | {head} | " + " | ".join(f"{by[c]:.3f}" for c in cats)
              + f" | {allv:.3f} | {sure:.3f} | {held:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
