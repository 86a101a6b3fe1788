#!/usr/bin/env python3
"""What huge pages are worth to plain decoding on this machine, against llama.cpp's own loop.

Page settings are per process (the patched ggml reads SPECEE_CPP_HUGEPAGES when it
allocates, llama.cpp maps or reads the weights at load), so every measurement is a fresh
process: our plain greedy loop on one prompt under each setting, and `llama-lookup` drafting
nothing (the bench's `lcpp-plain`, stock llama.cpp without our patches), in an order that
rotates from prompt to prompt. Prints per-token decode times and, per prompt, each setting's
speed relative to the first; the summary is the median of those per-prompt ratios (the
machine drifts by more than the effect between minutes, not between neighbouring runs).

    python scripts/pages_check.py [model] [--per-category 1] [--rounds 2] [--max-tokens 64]
                                  [--limit N] [--long-lived]
                                  [--write [--tag NAME]]   # the table into BENCHMARKS.md

Settings:
    4k-mapped      SPECEE_CPP_HUGEPAGES=0, the GGUF mapped (llama.cpp's default memory)
    huge-mapped    buffers advised onto huge pages, the GGUF mapped
    huge-private   buffers advised, the weights read into them (specee-cpp's default here)
    lcpp-plain     llama-lookup --spec-draft-n-max 0
    long-lived     (with --long-lived) our loop in this script's own process, the model
                   loaded once as the environment says (SPECEE_CPP_HUGEPAGES=0 before the
                   command: 4 KiB pages), as `bench` runs it: how a process's age weighs
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from specee_cpp.config import N_CTX

SETTINGS = ("4k-mapped", "huge-mapped", "huge-private", "lcpp-plain")

CHILD = r"""
import json, sys
from specee_cpp.config import LoadConfig
from specee_cpp.engine.llm import LLM
from specee_cpp.memory import anon_huge_bytes
model, mmap = sys.argv[1], sys.argv[2] == "1"
max_tokens, n_ctx = int(sys.argv[3]), int(sys.argv[4])
with LLM(model, config=LoadConfig(mmap=mmap, n_ctx=n_ctx)) as llm:
    r = llm.generate(sys.stdin.read(), chat=False, max_tokens=max_tokens, mode="plain")
    held = anon_huge_bytes()
print(json.dumps({"decode_s": r.stats.decode_s, "n_decode": r.stats.n_decode,
                  "tokens": r.tokens, "huge": held, "after": anon_huge_bytes()}))
"""


def child_run(model: str, mmap: bool, huge_pages: bool, text: str, max_tokens: int,
              n_ctx: int = N_CTX) -> dict:
    """Our plain loop on ``text`` in a fresh process (nothing of this one's memory shapes
    where its buffers land), with a context of ``n_ctx`` tokens:
    decode_s, n_decode, the tokens, and the process's bytes on huge pages while the model is
    loaded ("huge") and after it is closed ("after")."""
    env = dict(os.environ, SPECEE_CPP_HUGEPAGES="1" if huge_pages else "0")
    r = subprocess.run([sys.executable, "-c", CHILD, model, "1" if mmap else "0",
                        str(max_tokens), str(n_ctx)],
                       input=text, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"our loop (mmap {mmap}, huge pages {huge_pages}) failed:\n"
                         f"{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def ours(model: str, setting: str, text: str, max_tokens: int) -> tuple[float, int]:
    out = child_run(model, mmap=setting != "huge-private", huge_pages=setting != "4k-mapped",
                    text=text, max_tokens=max_tokens)
    return out["decode_s"] / out["n_decode"], out["huge"] or 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--per-category", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--limit", type=int, default=0, help="only the first N prompts (0: all)")
    ap.add_argument("--long-lived", action="store_true",
                    help="also our loop in this process, the model loaded once")
    ap.add_argument("--write", action="store_true", help="write the table into BENCHMARKS.md")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import TAG_HELP, tagged, write_section

    ap.add_argument("--tag", default="", help=TAG_HELP)
    ns = ap.parse_args()

    from specee_cpp.bench import prompts
    from specee_cpp.bench.configs import CONFIGS
    from specee_cpp.bench.peers import LlamaCppPeers
    from specee_cpp.bench.suite import shorten
    from specee_cpp.config import LoadConfig
    from specee_cpp.engine.llm import LLM, resolve
    from specee_cpp.memory import anon_huge_bytes, describe as pages
    from specee_cpp.provenance import describe, machine

    settings = SETTINGS + (("long-lived",) if ns.long_lived else ())
    path = resolve(ns.model)
    peers = LlamaCppPeers(path, None, LoadConfig())   # the newest built tools
    # this process's model: the prompts' tokens, and the long-lived setting's loop
    llm = LLM(path, config=LoadConfig(mmap=None if ns.long_lived else True))
    chosen = prompts.per_category(prompts.load(str(prompts.DEV_PROMPTS)), ns.per_category)
    chosen = chosen[:ns.limit] if ns.limit > 0 else chosen
    work = []
    for p in chosen:
        text = llm.prompt_text(shorten(p, llm.model, ns.max_prompt_tokens).text)
        work.append((p.id, text, len(llm.prompt_tokens(text, chat=False))))
    where = describe(machine(llm.config.threads))
    if not ns.long_lived:
        llm.close()
    print(f"{where}; huge pages: {pages()}", flush=True)
    ms: dict[str, list[float]] = {s: [] for s in settings}
    huge: dict[str, int] = {}
    for rnd in range(ns.rounds):
        for i, (pid, text, n_prompt) in enumerate(work):
            k = (i + rnd) % len(settings)
            row = {}
            for s in settings[k:] + settings[:k]:
                if s == "lcpp-plain":
                    run = peers.run(CONFIGS["lcpp-plain"], text, n_prompt, ns.max_tokens)
                    row[s] = run.decode_s / run.n_decode
                elif s == "long-lived":
                    llm.reset()
                    st = llm.generate(text, chat=False, max_tokens=ns.max_tokens,
                                      mode="plain").stats
                    row[s], huge[s] = st.decode_s / st.n_decode, anon_huge_bytes() or 0
                else:
                    row[s], huge[s] = ours(ns.model, s, text, ns.max_tokens)
            for s in settings:
                ms[s].append(row[s])
            print(f"{rnd} {pid}: " + ", ".join(f"{s} {row[s] * 1000:.1f} ms"
                                               for s in settings), flush=True)
    llm.close()
    base = SETTINGS[0]
    lines = [f"Machine: {where}.", f"Huge pages: {pages()}.", "",
             f"{len(work)} prompts x {ns.rounds} rounds, {ns.max_tokens} tokens, one fresh "
             "process a measurement (long-lived: this one); speed relative to 4k-mapped = "
             "median over prompts of its time / the setting's time.", "",
             "| setting | ms a token (mean) | speed vs 4k-mapped (median) | on huge pages |",
             "|---|---:|---:|---:|"]
    for s in settings:
        rel = statistics.median(a / b for a, b in zip(ms[base], ms[s]))
        hp = f"{huge[s] >> 20} MiB" if s in huge else "(stock llama.cpp)"
        lines.append(f"| {s} | {statistics.mean(ms[s]) * 1000:.1f} | {rel:.3f}x | {hp} |")
    vs = statistics.median(a / b for a, b in zip(ms["lcpp-plain"], ms["huge-private"]))
    lines += ["", f"specee-cpp's default (huge-private) against `lcpp-plain`: **{vs:.3f}x** "
              "(median of per-prompt ratios)."]
    table = "\n".join(lines)
    print(table)
    if ns.write:
        cmd = " ".join(["python scripts/pages_check.py", *sys.argv[1:]])
        write_section(tagged("Weights on huge pages: plain decoding against llama.cpp's loop",
                             ns.tag),
                      f"`{cmd}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
