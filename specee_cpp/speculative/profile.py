"""Step-level profiling of speculative decoding: the data a draft-length controller is
fitted on (SpecKV's profile, on our pairs and quantization levels).

One JSONL record per speculative round: the target's quantization (name and bits per
weight), gamma, the draft's top-1
probability and entropy for each drafted token, how many were accepted, and the draft and
verify times. Appends to the output file and skips (prompt, gamma) pairs already in it, so
an interrupted profile resumes.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from ..engine.llm import LLM
from .decode import generate_spec


def profile(llm: LLM, prompts: list[tuple[str, str]], gammas: list[int], max_tokens: int,
            out: Path, progress: Callable[[int, int], None] | None = None) -> int:
    """Run every (prompt, gamma); prompts are (category, text). Returns records written."""
    from ..config import SamplingConfig
    from ..engine.steps import stream

    from ..errors import SpeceeError
    from ..provenance import describe, machine
    from ..records import records

    out = Path(out)
    done = set()
    where = machine(llm.config.threads)
    for rec in records(out, what="profile file", missing_ok=True, torn_tail=True):
        if rec.get("machine") != where:  # its timings would mix with ours
            raise SpeceeError(f"{out} holds records measured on another machine or "
                              f"build ({describe(rec.get('machine'))}); this one is "
                              f"{describe(where)}: use another output file")
        done.add((rec["prompt_id"], rec["gamma"]))
    quant, bpw = llm.model.info.quant, round(llm.model.bits_per_weight, 4)
    n_written, total, step = 0, len(prompts) * len(gammas), 0
    with open(out, "a", encoding="utf-8") as fh:
        for pid, (category, text) in enumerate(prompts):
            tokens = llm.prompt_tokens(text)
            for gamma in gammas:
                step += 1
                if (pid, gamma) in done:
                    continue
                rounds: list[dict] = []
                steps = generate_spec(llm.tgt.seq, llm.dft.seq, tokens, gamma, SamplingConfig(),
                                      trace=rounds.append)
                for _ in stream(steps, piece=llm.model.token_to_piece, is_eog=llm.model.is_eog,
                                max_tokens=max_tokens, n_prompt=len(tokens)):
                    pass
                # a (prompt, gamma) is written whole, so a resumed run never repeats half of it
                fh.write("".join(json.dumps(dict(r, prompt_id=pid, category=category,
                                                 target_quant=quant, target_bpw=bpw,
                                                 machine=where)) + "\n"
                                 for r in rounds))
                fh.flush()
                n_written += len(rounds)
                if progress:
                    progress(step, total)
    return n_written
