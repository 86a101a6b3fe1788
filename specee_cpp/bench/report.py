"""Benchmark records -> summary, markdown tables, JSON and a PNG chart.

The columns, each defined once (the fields are record.Record's):

- tok/s: sum of n_decode / sum of decode_s over the prompts every compared configuration
  finished; speed-up: that over plain's, in the same run; in brackets its 95% interval
  (``interval``: the (prompt, repeat) pairs resampled);
- end to end: the same with the prefill counted, sum of n_gen / sum of (prefill_s +
  decode_s), over plain's: what a user waits for the whole answer. A draft that reads the
  prompt up front does so in prefill (llama.cpp's tools too), which decode speed leaves out;
- prefill s: mean prefill_s; drafted, acceptance: sum of n_drafted, sum n_accept / sum
  n_drafted; exit ratio: sum n_exit / sum n_gen; mean exit layer: sum exit_layer_sum /
  sum n_exit;
- agreement (teacher-forced): mean of the records' agreement;
- identical to plain: fraction of prompts whose text starts with plain's; common prefix:
  mean characters in common with plain's text; pass@1: mean of passed (HumanEval).
"""
from __future__ import annotations

import json
import re
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.sequence import common_prefix
from .configs import BenchConfig
from .record import Record


def decode_speed(r: Record) -> tuple[int, float]:
    """(tokens, seconds) of a record's decode: the tok/s column."""
    return r.n_decode, r.decode_s


def end_to_end(r: Record) -> tuple[int, float]:
    """(tokens, seconds) of a whole answer, prefill included: the end-to-end column."""
    return r.n_gen, r.prefill_s + r.decode_s


# the speeds a configuration is compared with plain's by: the key prefix of each
MEASURES = {"": decode_speed, "e2e_": end_to_end}


def _speed(recs: list[Record], measure: Callable[[Record], tuple[int, float]]) -> float:
    """Pooled tokens per second of ``recs`` under ``measure`` (0 without any time)."""
    n = sum(measure(r)[0] for r in recs)
    s = sum(measure(r)[1] for r in recs)
    return n / s if s > 0 else 0.0


def _agg(recs: list[Record]) -> dict:
    n_gen = sum(r.n_gen for r in recs)
    dec = sum(r.decode_s for r in recs)
    out = {"prompts": len(recs), "n_gen": n_gen, "decode_s": dec,
           **{f"{k}tps": _speed(recs, m) for k, m in MEASURES.items()},
           "prefill_s": sum(r.prefill_s for r in recs) / len(recs) if recs else 0.0}
    drafted = [r for r in recs if r.n_drafted is not None]
    if drafted:
        nd = sum(r.n_drafted for r in drafted)
        out["n_drafted"] = nd
        out["acceptance"] = sum(r.n_accept for r in drafted) / nd if nd else None
    exited = [r for r in recs if r.n_exit is not None]
    if exited:
        ne = sum(r.n_exit for r in exited)
        out["exit_ratio"] = ne / max(sum(r.n_gen for r in exited), 1)
        out["mean_exit_layer"] = sum(r.exit_layer_sum for r in exited) / ne if ne else None
    agreed = [r.agreement for r in recs if r.agreement is not None]
    if agreed:
        out["agreement"] = sum(agreed) / len(agreed)
    predicted = [r.prediction for r in recs if r.prediction is not None]
    if predicted:   # summed over prompts: [accepted, rejected] prediction tokens
        out["prediction"] = [sum(a for a, _ in predicted), sum(b for _, b in predicted)]
    scored = [r for r in recs if r.passed is not None]
    if scored:
        out["pass_at_1"] = sum(r.passed for r in scored) / len(scored)
    return out


# Resamples of the pairs behind a speed-up; seeded, so a report is the same each time it is
# written from the same records
RESAMPLES = 2000


def interval(pairs: list[tuple[Record, Record]], level: float = 0.95,
             measure: Callable[[Record], tuple[int, float]] = decode_speed
             ) -> tuple[float, float] | None:
    """The ``level`` interval of the pooled speed-up of ``pairs`` (each a configuration's
    record and plain's of the same prompt and repeat): percentiles over RESAMPLES draws of
    the pairs with replacement. On a shared 2-core machine one 64-token record reads
    0.82-1.13x of plain with nothing drafted, so a
    category's three prompts alone cannot tell 0.97x from 1.00x; this says how far apart
    such readings are. Pairs are the unit: the spread mixes measurement noise with
    differences between prompts, and with a few prompts it understates the latter. None
    for fewer than two pairs. ``measure``: the (tokens, seconds) a speed is taken over
    (decode_speed, end_to_end)."""
    if len(pairs) < 2:
        return None
    a = np.array([[*measure(r), *measure(q)] for r, q in pairs], dtype=np.float64)
    pick = np.random.default_rng(0).integers(0, len(a), size=(RESAMPLES, len(a)))
    n, s, pn, ps = (a[:, k][pick].sum(axis=1) for k in range(4))
    ratio = (n / s) / (pn / ps)
    tail = (1.0 - level) / 2 * 100
    lo, hi = np.percentile(ratio, [tail, 100 - tail])
    return float(lo), float(hi)


def _vs_plain(pairs: list[tuple[Record, Record]], is_plain: bool) -> dict:
    """Speed-up over plain and its interval (None for plain itself), for each of MEASURES,
    of ``pairs`` (a configuration's record, plain's of the same prompt and repeat)."""
    recs, plain = [r for r, _ in pairs], [q for _, q in pairs]
    out = {}
    for kind, m in MEASURES.items():
        base = _speed(plain, m)
        out[f"{kind}speedup"] = _speed(recs, m) / base if base else None
        out[f"{kind}interval"] = None if is_plain else interval(pairs, measure=m)
    return out


def clipped(r: Record, max_tokens: int | None) -> Record:
    """A llama.cpp peer's record counting no tokens past the run's limit. The tools stop at
    ``max_tokens`` + 1 tokens (they check the limit after emitting), and llama-speculative-
    simple only once a round: a draft accepted in the last round runs past it (a 192-token
    code edit counted 241). The time of those extra tokens stays in, so this is
    conservative against the peer by at most its last round's extra rows."""
    if max_tokens is None or r.n_gen <= max_tokens + 1:
        return r
    over = r.n_gen - (max_tokens + 1)
    return replace(r, n_gen=r.n_gen - over, n_decode=max(r.n_decode - over, 0))


def summarize(records: list[Record], configs: list[BenchConfig],
              max_tokens: int | None = None) -> dict:
    """Per configuration, overall and per category, over the prompts that every listed
    configuration has a record for (an interrupted run compares like with like). Repeated
    measurements (``--repeats``) all count, each compared with plain's of the same repeat;
    ``prompts`` counts prompts, not measurements. With ``max_tokens`` (the run's limit) the
    llama.cpp peers' tokens past it are not counted (``clipped``)."""
    names = [c.name for c in configs]
    peer = {c.name for c in configs if c.kind == "llama.cpp"}
    records = [clipped(r, max_tokens) if r.config in peer else r for r in records]
    by = {((r.prompt_id, r.repeat), r.config): r for r in records}
    runs = list(dict.fromkeys((r.prompt_id, r.repeat) for r in records))
    complete = [p for p in runs if all((p, n) in by for n in names)]
    cats = {p: by[(p, "plain")].category for p in complete}
    summary: dict = {"prompts": len({p for p, _ in complete}),
                     "repeats": len({k for _, k in complete}), "configs": {}}
    for c in configs:
        recs = [by[(p, c.name)] for p in complete]
        entry = _agg(recs)
        plain = [by[(p, "plain")] for p in complete]
        entry |= _vs_plain(list(zip(recs, plain)), c.name == "plain")
        same = [r.text.startswith(q.text) for r, q in zip(recs, plain)]
        entry["identical"] = sum(same) / len(same) if same else None
        entry["common_prefix"] = (sum(common_prefix(r.text, q.text) for r, q in zip(recs, plain))
                                  / len(recs)) if recs else None
        entry["lossless"] = c.lossless
        entry["kind"] = c.kind
        entry["reference"] = c.reference
        entry["describe"] = c.describe
        per_cat = {}
        for cat in sorted(set(cats.values())):
            ps = [p for p in complete if cats[p] == cat]
            cat_pairs = [(by[(p, c.name)], by[(p, "plain")]) for p in ps]
            per_cat[cat] = {"prompts": len({p for p, _ in ps}),
                            "tps": _speed([r for r, _ in cat_pairs], decode_speed),
                            **_vs_plain(cat_pairs, c.name == "plain")}
        entry["categories"] = per_cat
        summary["configs"][c.name] = entry
    return summary


def _f(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _speedup(e: dict, kind: str = "") -> str:
    """A speed-up with its interval, when it has one: '0.986 (0.97-1.00)'; ``kind`` "e2e_"
    for the end-to-end one."""
    iv = e.get(f"{kind}interval")
    return _f(e.get(f"{kind}speedup"), ".3f") + (f" ({iv[0]:.2f}-{iv[1]:.2f})" if iv else "")


def markdown(summary: dict, command: str, settings: str) -> str:
    """The section that goes into docs/BENCHMARKS.md: command, settings, two tables."""
    cfgs = summary["configs"]
    has_pass = any("pass_at_1" in e for e in cfgs.values())
    head = ("| configuration | tok/s | speed-up vs plain | end to end vs plain | prefill s | "
            "drafted | acceptance | "
            "exit ratio | mean exit layer | agreement (teacher-forced) | identical to plain | "
            "common prefix (chars) |" + (" pass@1 |" if has_pass else ""))
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, e in cfgs.items():
        ident = _f(e["identical"], ".2f")
        if e["lossless"] and name != "plain":
            ident += " (lossless mode)"
        rows.append(
            f"| {name} | {e['tps']:.1f} | {_speedup(e)} | {_speedup(e, 'e2e_')} | "
            f"{e['prefill_s']:.2f} | "
            f"{e.get('n_drafted', '-')} | {_f(e.get('acceptance'), '.3f')} | "
            f"{_f(e.get('exit_ratio'), '.2f')} | {_f(e.get('mean_exit_layer'), '.1f')} | "
            f"{_f(e.get('agreement'), '.3f')} | {ident} | {_f(e['common_prefix'], '.0f')} |"
            + (f" {_f(e.get('pass_at_1'), '.3f')} |" if has_pass else ""))
    cats = list(next(iter(cfgs.values()))["categories"]) if cfgs else []
    others = [n for n in cfgs if n != "plain"]
    crows = ["| category | prompts | plain tok/s | " + " | ".join(others) + " |",
             "|---|---|---|" + "---|" * len(others)]
    erows = ["| category | " + " | ".join(others) + " |", "|---|" + "---|" * len(others)]
    for cat in cats:
        plain = cfgs["plain"]["categories"][cat]
        crows.append(f"| {cat} | {plain['prompts']} | {plain['tps']:.1f} | "
                     + " | ".join(_speedup(cfgs[n]["categories"][cat]) for n in others)
                     + " |")
        erows.append(f"| {cat} | " + " | ".join(_speedup(cfgs[n]["categories"][cat], "e2e_")
                                                for n in others) + " |")
    legend = "\n".join(f"- `{n}`: {e['describe']}" for n, e in cfgs.items())
    verdict = best_lines(cfgs) + length_note(cfgs) + prediction_note(cfgs)
    reps = summary.get("repeats", 1)
    times = f", each measured {reps} times (all measurements pooled)" if reps > 1 else ""
    shown = any(e.get("interval") for e in cfgs.values())
    spread = (f" In brackets: the 95% interval of a speed-up, from {RESAMPLES:,} resamples of "
              f"its (prompt, repeat) pairs." if shown else "")
    return (f"`{command}`\n\n{settings} {summary['prompts']} prompts{times}; "
            f"{time.strftime('%Y-%m-%d')}.{spread}\n\n" + "\n".join(rows) + f"\n\n{verdict}"
            + "\n\nSpeed-up vs plain by category (same run):\n\n" + "\n".join(crows)
            + "\n\nEnd to end (prefill and decode) vs plain by category (same run):\n\n"
            + "\n".join(erows)
            + f"\n\nConfigurations:\n\n{legend}\n")


def prediction_note(cfgs: dict) -> str:
    """A sentence with the prediction tokens each configuration given one saw in its outputs
    and did not (OpenAI's accepted/rejected_prediction_tokens), and what it drafted from it."""
    parts = []
    for name, e in cfgs.items():
        if "prediction" in e:
            a, r = e["prediction"]
            parts.append(f"`{name}` {a} accepted / {r} rejected")
    return (" Prediction tokens over all prompts: " + "; ".join(parts) + ".") if parts else ""


def best_lines(cfgs: dict) -> str:
    """Our best lossless and lossy configurations against the best peer of the run: the
    comparison every claim is made on."""
    def best(names):
        names = [n for n in names if cfgs[n]["speedup"] is not None]
        return max(names, key=lambda n: cfgs[n]["speedup"]) if names else None

    ours = [n for n, e in cfgs.items() if e["kind"] == "ours" and n != "plain"]
    peer = best([n for n, e in cfgs.items() if e["kind"] != "ours" and not e.get("reference")])
    refs = [n for n, e in cfgs.items() if e.get("reference") and e["speedup"] is not None]
    parts = []
    for label, names in (("lossless", [n for n in ours if cfgs[n]["lossless"]]),
                         ("lossy", [n for n in ours if not cfgs[n]["lossless"]])):
        b = best(names)
        if b:
            parts.append(f"our best {label}: `{b}` {cfgs[b]['speedup']:.3f}x")
    if peer:
        parts.append(f"best peer: `{peer}` {cfgs[peer]['speedup']:.3f}x")
    parts += [f"reference `{n}` {cfgs[n]['speedup']:.3f}x" for n in refs]
    return ("Speed-up vs plain, " + "; ".join(parts) + ".") if parts else ""


def length_note(cfgs: dict, tolerance: float = 0.1) -> str:
    """A sentence where configurations generated other amounts of text than plain (more than
    ``tolerance`` apart), so that their tok/s is over other text and the fair reading is
    each side against its own plain: a lossy mode's other answers, or peers that ran to the
    token limit past a stop string they cannot apply (HumanEval: 2389 tokens for 24 tasks
    against our 1106, in runs before peers were sized to our answers, Runner.peer_limit)."""
    if "plain" not in cfgs or not cfgs["plain"].get("n_gen"):
        return ""
    base = cfgs["plain"]["n_gen"]
    off = [n for n, e in cfgs.items() if abs(e.get("n_gen", base) - base) > tolerance * base]
    if not off:
        return ""
    return (f" Tokens generated: `plain` {base}, "
            + ", ".join(f"`{n}` {cfgs[n]['n_gen']}" for n in off)
            + ": their tok/s is over other text; compare each with its own plain.")


def write_json(path: Path, command: str, settings: dict, summary: dict,
               records: list[Record]) -> None:
    path.write_text(json.dumps({"command": command, "settings": settings,
                                "date": time.strftime("%Y-%m-%d"), "summary": summary,
                                "records": [r.as_dict() for r in records]}, indent=1))


def write_png(path: Path, summary: dict, title: str = "") -> None:
    """Grouped bars: speed-up vs plain per category (and overall) per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfgs = {n: e for n, e in summary["configs"].items() if n != "plain"}
    if not cfgs:
        return
    cats = list(next(iter(cfgs.values()))["categories"]) + ["all"]
    width = 0.8 / len(cfgs)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(cats) + 0.25 * len(cfgs)), 4.8))
    for i, (name, e) in enumerate(cfgs.items()):
        vals = [e["categories"][c]["speedup"] or 0 for c in cats[:-1]] + [e["speedup"] or 0]
        ax.bar([j + (i - (len(cfgs) - 1) / 2) * width for j in range(len(cats))], vals,
               width, label=name + ("" if e["lossless"] else " (lossy)"))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cats)), cats, rotation=20)
    ax.set_ylabel("decode speed-up vs plain")
    ax.set_title(title or "speed-up per category")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    tmp = path.with_name(path.name + ".partial.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)


# "measured on AMD EPYC (SSE3 ... REPACK), 2 threads": the CPU part of provenance.describe()
# that every measured section carries, after the words the benches and scripts put before it;
# the build is left out so that a rerun on the same machine replaces its own section
_MACHINE = re.compile(r"(?:[Mm]easured on |Machine: |` \()([^;`\n]+?) "
                      r"\(([A-Z0-9_ ]+)\), \d+ threads")


def section_machine(text: str) -> str | None:
    """The 'CPU (features)' a section was measured on, or None where it names none."""
    m = _MACHINE.search(text)
    return f"{m.group(1).strip()} ({m.group(2)})" if m else None


def machine_tag(machine: str) -> str:
    """A short readable name for a machine: its CPU and widest vector unit ('AMD EPYC, AVX2')."""
    cpu, _, feats = machine.partition(" (")
    names = feats.rstrip(")").split()
    isa = next((label for flag, label in (("AMX_INT8", "AMX"), ("AVX512", "AVX-512"),
                                          ("AVX2", "AVX2"), ("NEON", "NEON"))
                if flag in names), "")
    cpu = cpu.replace("(R)", "").replace("(TM)", "").strip()
    return ", ".join(p for p in (cpu, isa) if p)


def write_section(path: Path, heading: str, body: str) -> str:
    """Write ``## heading`` + body into a markdown file, replacing a section of that heading.

    A section measured on another machine is not replaced: the new one goes under the
    heading with that machine's tag appended ('... (AMD EPYC, AVX2)'), because a fixed-heading
    script rerun elsewhere once wiped a table that no later run could reproduce. Returns the
    heading written."""
    text = path.read_text() if path.exists() else (
        "# Benchmarks\n\nEvery table states the command that produced it; speeds are ratios "
        "taken in the same run.\n")
    here = section_machine(body)
    # the full machine string names a heading no other machine can claim: the last resort
    names = [heading] + ([f"{heading} ({machine_tag(here)})", f"{heading} ({here})"]
                         if here else [])
    for heading in names:
        start = text.find(f"## {heading}\n")
        end = text.find("\n## ", start + 1) if start >= 0 else -1
        there = section_machine(text[start:end if end >= 0 else None]) if start >= 0 else None
        if there is None or here is None or there == here:
            break
    section = f"## {heading}\n\n{body.strip()}\n"
    if start >= 0:
        text = text[:start] + section + (text[end:] if end >= 0 else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)
    return heading
