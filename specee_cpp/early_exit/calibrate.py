"""Calibration: record probes at every layer on dev prompts, label them, fit the predictors,
profile where exits happen and write the bundle with its offline schedule.

Per prompt: greedy generation at full depth gives the continuation; the provider is run
along it for the candidates; then the continuation is decoded again in one staged batch
(teacher forcing), running layer by layer with the candidates probed and the full head
computed at each calibrated layer. The residual at layer l of a token depends only on the
layers below l, so these probes and argmaxes are exactly those of a sequential decode.
Each prompt's record is saved as it is made: a stopped calibration resumes where it was.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..config import EXIT_TARGETS, N_CAND
from ..engine.llm import LLM
from ..engine.plain import generate_plain
from ..errors import SpeceeError
from ..paths import home
from ..provenance import machine
from .candidates import CandidateProvider
from .features import PAD_GAP, features, softmax
from ..mlp import train_mlp
from .predictor import Predictors, stack
from .quality import RULES, choose_plans, exit_error, plan_for, pooled, simulate
from .scheduler import offline_layers

Progress = Callable[[str, int, int], None]



@dataclass(frozen=True)
class CalibConfig:
    n_tokens: int = 48          # continuation length per prompt
    min_layer: int = 0          # first calibrated layer (0: n_layer // 2)
    k: int = N_CAND
    # prompts held out (spread over the pool) for the exit plans and the validation report
    val_frac: float = 0.4
    hidden: int = 128
    epochs: int = 60
    threshold: float = 0.5
    prev_gaps: tuple[int, ...] = (1, 2, 3)  # previous-probe distances the delta feature sees
    seed: int = 0


def collect_one(llm: LLM, provider: CandidateProvider, prompt: list[int], layers: list[int],
                n_tokens: int, k: int) -> dict:
    """Probes and argmax at ``layers`` along the greedy continuation of ``prompt``."""
    seq = llm.tgt.seq
    gen = []
    for step in generate_plain(seq, prompt, lambda s: s.argmax()):
        if llm.model.is_eog(step.token) or len(gen) == n_tokens:
            break
        gen.append(step.token)
    if len(gen) < 2:
        return {}
    provider.reset(prompt)
    cand = np.zeros((len(gen), k), dtype=np.int32)
    n_cand = np.zeros(len(gen), dtype=np.int32)
    for i, t in enumerate(gen):
        c = provider.propose()[:k]
        n_cand[i] = len(c)
        cand[i, :len(c)] = c
        cand[i, len(c):] = c[0] if len(c) else 0
        provider.accept(t)
    inputs = [prompt[-1]] + gen[:-1]
    ctx = seq.ctx
    seq.rewind(len(prompt) - 1)
    seq.begin_staged(inputs, all_logits=True)
    try:
        probes = np.zeros((len(layers), len(gen), k), dtype=np.float32)
        argmax = np.zeros((len(layers), len(gen)), dtype=np.int32)
        for j, layer in enumerate(layers):
            probes[j] = ctx.stage_run(layer, cand)
            ctx.stage_head()
            argmax[j] = [int(np.argmax(ctx.logits(i))) for i in range(len(gen))]
        ctx.stage_run(llm.model.n_layer)
        final = np.array([int(np.argmax(ctx.logits(i))) for i in range(len(gen))], dtype=np.int32)
    except BaseException:
        seq.abort_staged(len(inputs))
        raise
    return {"probes": probes, "argmax": argmax, "final": final, "gen": np.array(gen, np.int32),
            "cand": cand, "n_cand": n_cand}


def masked(probes: np.ndarray, n_cand: np.ndarray) -> np.ndarray:
    """Probe logits with the filler entries of short candidate lists replaced by padding."""
    out = probes.astype(np.float64).copy()
    k = probes.shape[-1]
    for c in range(1, k):  # same padding as features.pad_logits applies at decoding time
        rows = n_cand == c
        if rows.any():
            low = out[..., rows, :c].min(axis=-1, keepdims=True) - PAD_GAP
            out[..., rows, c:] = low
    return out


def training_arrays(rec: dict, layers: list[int], j: int, k: int, gaps) -> tuple:
    """Features and labels at layer index j of one record (its ``logits``: masked probes),
    for a first probe and for each previous-probe distance in ``gaps`` (delta features as
    the scheduler will see them)."""
    ok = rec["n_cand"] > 0
    lg = rec["logits"][:, ok]
    label = (rec["argmax"][j, ok] == rec["final"][ok]).astype(np.float64)
    xs, ys = [features(lg[j], None, k)[0]], [label]
    for g in gaps:
        if layers[j] - g in layers:
            jp = layers.index(layers[j] - g)
            xs.append(features(lg[j], softmax(lg[jp]), k)[0])
            ys.append(label)
    return np.concatenate(xs), np.concatenate(ys)


def split(records: list, val_frac: float) -> tuple[list, list]:
    """(training, held-out) records: the held-out ones spread evenly over the list, so that
    every category of a pool sorted by category is in both."""
    n_val = max(1, int(len(records) * val_frac))
    held = {i * len(records) // n_val for i in range(n_val)}
    return ([r for i, r in enumerate(records) if i not in held],
            [r for i, r in enumerate(records) if i in held])


def prompt_key(text: str) -> str:
    """A prompt's name in the records and in a bundle's list of the prompts it saw."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def records_dir(llm: LLM, provider: CandidateProvider, layers: list[int],
                cfg: CalibConfig) -> Path:
    """Where the records of this target, provider, layer set and record shape are kept."""
    key = hashlib.sha256(json.dumps([llm.model.sha256, provider.name, layers, cfg.n_tokens,
                                     cfg.k]).encode()).hexdigest()[:12]
    return home() / "calibration" / f"{provider.name}-{key}"


def collect(llm: LLM, provider: CandidateProvider, prompts: list[str], layers: list[int],
            cfg: CalibConfig, progress: Progress | None = None) -> list[dict]:
    """Calibration records of ``prompts`` (each kept on disk as it is made: a stopped run
    resumes; one on another subset of the same prompts reuses them)."""
    work = records_dir(llm, provider, layers, cfg)
    work.mkdir(parents=True, exist_ok=True)
    records = []
    for i, text in enumerate(prompts):
        name = prompt_key(text)
        f = work / f"{name}.npz"
        if not f.exists():
            rec = collect_one(llm, provider, llm.prompt_tokens(text), layers, cfg.n_tokens, cfg.k)
            tmp = work / f"{name}.partial.npz"
            np.savez(tmp, **rec) if rec else np.savez(tmp, empty=np.zeros(0))
            tmp.replace(f)  # a record appears only once complete
        with np.load(f) as z:
            rec = {field: z[field] for field in z.files}
        if "final" in rec:
            rec["key"] = name
            # padded once here; training and validation read it for every layer
            rec["logits"] = masked(rec["probes"], rec["n_cand"])
            records.append(rec)
        if progress:
            progress("collecting", i + 1, len(prompts))
    return records


def calibrate(llm: LLM, provider: CandidateProvider, prompts: list[str], out: Path,
              cfg: CalibConfig = CalibConfig(), progress: Progress | None = None) -> dict:
    """Run the whole calibration; writes the bundle to ``out`` and returns the report."""
    n_layer = llm.model.n_layer
    min_layer = cfg.min_layer or n_layer // 2
    if not 1 <= min_layer < n_layer - 1:
        raise SpeceeError(f"min_layer {min_layer} out of range [1, {n_layer - 1})")
    layers = list(range(min_layer, n_layer - 1))
    out = Path(out)
    target_sha = llm.model.sha256
    records = collect(llm, provider, prompts, layers, cfg, progress)
    work = records_dir(llm, provider, layers, cfg)
    if len(records) < 2:
        raise SpeceeError(f"calibration collected {len(records)} usable prompts; need at least 2")

    train, val = split(records, cfg.val_frac)
    fitted, report_layers = [], {}
    for j, layer in enumerate(layers):
        X, y = zip(*(training_arrays(r, layers, j, cfg.k, cfg.prev_gaps) for r in train))
        X, y = np.concatenate(X), np.concatenate(y)
        fitted.append(train_mlp(X, y, hidden=cfg.hidden, epochs=cfg.epochs, seed=cfg.seed + j))
        if progress:
            progress("training", j + 1, len(layers))
    meta = {"target_name": llm.model.path.name, "target_sha256": target_sha, "n_layer": n_layer,
            "provider": provider.name, "calibration": asdict(cfg),
            "trained_on": f"{len(train)} prompts (dev data)", "created": time.strftime("%Y-%m-%d"),
            # every prompt it saw, fitting or planning: a measurement of its error skips them
            "prompts": [prompt_key(t) for t in prompts],
            # the measured probe/exit costs below are this machine's
            "machine": machine(llm.config.threads)}
    pred = stack(layers, fitted, cfg.k, cfg.threshold, meta)

    # validation: per-layer precision/recall of the predictors, and where exits happen
    for j, layer in enumerate(layers):
        X, y = zip(*(training_arrays(r, layers, j, cfg.k, ()) for r in val))
        X, y = np.concatenate(X), np.concatenate(y)
        fire = pred.prob(layer, X) > cfg.threshold
        tp = float((fire & (y > 0)).sum())
        report_layers[layer] = {"precision": tp / max(fire.sum(), 1),
                                "recall": tp / max(y.sum(), 1),
                                "positive_rate": float(y.mean()) if len(y) else 0.0}
    everywhere = {layer: cfg.threshold for layer in layers}
    sims = simulate(pred, pooled(val), layers, everywhere)
    exits, correct = sims[0], sims[1].astype(bool)
    n_tok = len(exits)
    rate = {layer: float((exits == layer).sum()) / n_tok for layer in layers}
    offline = offline_layers(rate)
    # per rule and quality target, the thresholds whose exits, decoded together on the
    # held-out prompts, stay within it (quality.choose_plans)
    plans = {}
    for i, rule in enumerate(RULES):
        plans[rule] = choose_plans(pred, val, layers, rule, EXIT_TARGETS)
        if progress:
            progress("choosing thresholds", i + 1, len(RULES))
    pred.meta.update(offline=offline, exit_rate=rate, exit_plans=plans,
                     plans_on=f"{len(val)} held-out prompts (dev data)")
    pred.save(out)
    report = {
        "bundle": str(out), "work": str(work), "machine": pred.meta["machine"], "layers": layers,
        "per_layer": report_layers, "offline": offline,
        "exit_rate": rate,
        "validation_tokens": n_tok, "exit_ratio": float((exits >= 0).mean()),
        "exit_agreement": float(correct[exits >= 0].mean()) if (exits >= 0).any() else None,
        "mean_exit_layer": float(exits[exits >= 0].mean()) if (exits >= 0).any() else None,
        "exit_plans": plans,
    }
    # the file is shipped with bundles: no machine paths in it (names under the cache)
    portable = dict(report, bundle=out.name, work=f"calibration/{work.name}")
    out.with_suffix(".report.json").write_text(json.dumps(portable, indent=1))
    return report


def held_out_error(llm: LLM, provider: CandidateProvider, pred: Predictors,
                   prompts: list[tuple[str, str]], targets: list[float],
                   progress: Progress | None = None) -> dict:
    """How often the exits of each rule at each quality target (``--max-exit-error``) were
    wrong on ``prompts`` ((category, text) pairs; those the bundle saw are skipped), decoded
    as ``ee`` decodes with every allowed layer probed: ``{rule: {target: {"all": figures,
    category: figures}}}`` (quality.exit_error), and ``"prompts"``: how many were measured."""
    seen = set(pred.meta.get("prompts", ()))
    if not seen:
        raise SpeceeError("the bundle does not list the prompts it was fitted on, so none can be "
                          "called held out; fit it again with specee-cpp calibrate")
    category = {prompt_key(text): c for c, text in prompts if prompt_key(text) not in seen}
    texts = [text for _, text in prompts if prompt_key(text) in category]
    cfg = CalibConfig(n_tokens=pred.meta["calibration"]["n_tokens"], k=pred.k)
    records = collect(llm, provider, texts, pred.layers, cfg, progress)
    out: dict = {"prompts": len(texts)}
    by_cat = {c: [r for r in records if category[r["key"]] == c]
              for c in dict.fromkeys(category.values())}
    for rule in RULES:
        for t in targets:
            th = plan_for(pred.meta["exit_plans"], rule, t)[0]
            out.setdefault(rule, {})[f"{t:g}"] = {
                "all": exit_error(pred, records, pred.layers, th, rule),
                **{c: exit_error(pred, rs, pred.layers, th, rule) for c, rs in by_cat.items()}}
    return out
