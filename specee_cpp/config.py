"""Configuration: the defaults a user can change (dataclasses) and the tuning constants the
decoding logic decides with, each written here once with its reason."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from .errors import SpeceeError

# Defaults shared by several modules, each written here once.
N_CTX = 4096          # context window of a session (chat, generate, bench, profile)
N_BATCH = 512         # tokens per llama_decode batch
N_CTX_COSTS = 2048    # context of a `costs` measurement (a short chat turn fits)
# the prompt whose tokens, repeated, fill the caches of a cost measurement (speculative/cost.py), a
# draft variant's screen (speculative/variants.py) and the draft's attention timing
# (engine/draft_attention.py); and the contexts they are measured at: a short chat turn and a
# long one (a 1k-token cache makes a token measurably dearer)
COST_PROMPT = "Write a function that parses a date and explain it."
COST_CONTEXTS = (128, 1024)
N_CAND = 4            # candidates per token that early-exit predictors see (SpecEE's top-4)
# early exit's quality target: at most this fraction of a layer's exits may emit another
# token than full depth would (on held-out calibration prompts); docs/early-exit.md
MAX_EXIT_ERROR = 0.01
MAX_GAMMA = 8         # longest draft the draft-length policies consider
MAX_VERIFY = 16       # largest target batch the cost model measures one by one (15 drafts)
# free drafts from the context may run longer: a long copy verified in one batch of up to 64
# (on a 2-core CPU a row of a 48-row batch costs 0.41 of a token, of a 16-row one 0.51),
# measured at these sizes and interpolated between them
LONG_BATCHES = (24, 32, 48, 64)
MAX_FREE_VERIFY = LONG_BATCHES[-1]
FIXED_GAMMAS = (1, 2, 3, 4, 6, MAX_GAMMA)  # fixed draft lengths profiled and benchmarked
# the server's slots (engine/slots.py): a step decodes at most SLOT_STEP rows, every waiting
# slot's together, a prompt's as far as there is room. Within the batch sizes a verification
# takes, whose rows decode bit for bit as they do in any other batch of those sizes: a slot's
# greedy output does not depend on what the other slots decode; and a slot's longest
# verification (a context draft's) fits one step
SLOT_STEP = MAX_FREE_VERIFY
# the most sequences (slots) one llama.cpp context holds (its LLAMA_MAX_SEQ)
MAX_SEQ = 256
# a new prompt's rows go first in a step, up to this many while other slots wait, then the
# others go first for a step: a prompt of up to one batch is read as fast as it is alone (its
# first token waits on no one's verification), a longer one pauses the others a batch at a time
SLOT_PROMPT_AHEAD = N_BATCH
# serve's slots where --parallel is not given (server/slot_count.py): llama-server's default
# count, taken where a step of that many requests gives at least SLOT_GAIN times the tokens a
# second of one request at a time on this machine; below it the step's gain is not worth
# slots' KV caches (n_ctx each) and a fuller step's slower tokens
SLOT_DEFAULT = 4
SLOT_GAIN = 1.25


# ---- tuning: the constants the decoding logic decides with ----------------------------------
# Each line says why the value is what it is; the measurements behind them are in
# docs/draft-length.md (speculative decoding) and docs/early-exit.md (early exit).

# draft-length policies (speculative/policies.py)
CONTEXT_STEP = 64          # re-read the cost table each time the cache grows this much (cheap)
EXPLORE_HORIZON = 64       # tokens a lesson or a catch-up pays off over when no limit is set
EXPLORE_EVERY = 16         # plain steps before an exploring round refreshes the statistics
ROUND_CATCH_UP = 2         # tokens a draft is behind after a drafted round (never a batch)
GUARD_WINDOW = 4           # drafted rounds a guard judges before a verdict (one is noise)
GUARD_FIRST_BACKOFF = 16   # plain steps after a losing verdict; doubles while probes lose
GUARD_MAX_BACKOFF = 512    # so that a machine that changes is probed again within an answer
MODEL_GUARD_MEMORY = 8     # the draft model's guard outlives answers: judged on more rounds
PMIN_P = 0.75              # llama.cpp draft-simple's default p-min (the baseline as shipped)
HF_START, HF_MAX = 4, 16   # Hugging Face's heuristic as it ships
# the round model's correction by what its rounds reached (speculative/acceptance.py):
# decayed over ~16 rounds, shrunk towards 1 as if 4 rounds had come out as predicted, kept
# within [0.5, 1.5] (a factor that stops drafting gets no rounds to undo it), halved every
# 128 plain steps for the same reason
CORRECTION_WINDOW, CORRECTION_PRIOR = 16, 4.0
CORRECTION_LO, CORRECTION_HI, CORRECTION_HALF_LIFE = 0.5, 1.5, 128
# what batches really cost against the table (speculative/cost.py VerifyScale): shrunk by 8
# observations (one round is noise), remembered over ~64, each ratio clipped to [1/2, 2]
SCALE_PRIOR, SCALE_WINDOW, SCALE_CLIP = 8.0, 64, (0.5, 2.0)

# the context drafter (speculative/context_drafter.py)
TRIE_DEPTH = 8             # longest suffix matched: longer matches add lookups, not accuracy
BANDS = (3, 5)             # match lengths 1-2, 3-4, 5+: the built-in guess's posteriors
COPY_PRIOR = 6.0           # rounds of the per-answer correction's prior (4 and 6 alike, 3 lost RAG)
HIT_ALPHA = 1.0 / 16       # the recent hit rate: a moving average over ~16 tokens
HIT_PRIOR = 0.5            # a first guess's hit rate before any was seen
COPY_GRAM = 4              # tokens a copy in progress is matched on
FOLLOW_MIN = 16            # tokens repeated before a copy is followed whole (8-24 replayed alike)
FOLLOW_HITS = 0.8          # the first guesses' recent hit rate a followed copy needs

# the caller's predicted output (speculative/prediction.py)
PREDICTION_GRAM = 2        # output tokens that rejoin the prediction near where it left it
PREDICTION_FAR_GRAM = 4    # ... and anywhere else in it (a short gram recurs by chance there)
PREDICTION_NEAR = 64       # tokens after the point left within which the short gram is trusted
# where the draft model's tokens rejoin the prediction, its continuation is verified with
# them, as long as a rejoin of the output would be drafted; until the output has followed
# the prediction this many tokens in a row, one other than right where it left (the
# prediction's start, after a preamble such as a code fence) is priced as a rejoin's
# first token throughout, a short tail: code shares short grams (indents, brackets,
# keywords), and a prediction never followed that long may be unrelated text whose
# chance rejoins add rows that break
PREDICTION_TAIL_RUN = 12
# a drafted prediction token is right (Beta prior: kept, broken), by how far into a run of
# the prediction the output will be when it comes (PREDICTION_BANDS: where each band starts):
# just (re)joined, 2 in 3 (a rejoin of an edit mostly holds; two breaks of a chance one stop
# its drafts); 2-15 tokens in, 9 in 10; from 16 on, an edit's unchanged stretch, 199 in 200
# (fitted on the dev set's code edits, where a run's first tokens broke far more often than
# its later ones: an edit's changes cluster)
PREDICTION_BANDS = (0, 2, 16)
PREDICTION_PRIORS = ((2.0, 1.0), (9.0, 1.0), (49.75, 0.25))
# a substitution the output made in the prediction (a rename) and is drafted again where its
# span recurs: a span of up to PREDICTION_SPAN tokens, replaced by up to
# PREDICTION_REPLACEMENT (longer changes are rewrites, which do not repeat token for token)
PREDICTION_SPAN = 3
PREDICTION_REPLACEMENT = 8
# a verification's cost in plain tokens where no table of this machine's is at hand (plain
# mode): 1 + PREDICTION_ROW_COST per row past the first, the dearest rows measured on any
# machine (a 2-core Zen 4 EPYC, whose AVX-512 runs as two 256-bit halves: 16 rows 8.6 and
# 64 rows 32.9 plain tokens at 1024 tokens of context), so a draft that pays here pays on
# every machine
PREDICTION_ROW_COST = 0.5

# the copy model's fit (speculative/context_acceptance.py)
COPY_PER_STREAM = 100      # samples per output stream: no stream outweighs the others
COPY_EPOCHS = 300          # at 30 the nets were still learning (held-out loss 0.325 vs 0.297)
COPY_MEMBERS = 3           # nets averaged: one net's replayed speed moved 1.5% with its seed

# cheaper drafts chosen per machine (speculative/variants.py)
# acceptances a variant is scored at: general prompts (~0.6) to code and rewrites (0.8-0.9)
WORK_LEVELS = (0.6, 0.7, 0.8, 0.9)
# the draft model is kept only where it is predicted to gain this much at some work level:
# the cost table's rounds leave out what holding a draft costs besides them
MODEL_DRAFT_MARGIN = 1.05
# a table whose verdict on the draft model lies this close to the margin (relative) is
# measured twice more and taken as the median of three: one 2-core VM read verify(4) at
# 1.42, 1.50 and 1.87 plain tokens within 20 minutes, enough to flip the verdict
NEAR_MARGIN = 0.10
STEADY_RUNS = 3
# A batch of more rows does at least the work of a smaller one (every weight is read once
# either way), so a table in which some batch costs under this share of a smaller batch was
# disturbed while it measured: a neighbour slowed some plain references and not the batches
# timed against them, or the other way round. Such a table is measured STEADY_RUNS times and
# taken as the median, and kept only if that passes. Undisturbed tables dip to 0.73 at worst
# (a model of 0.1 ms a token, where noise is largest); a busy 2-core VM produced 0.23.
PLAUSIBLE_DIP = 0.4
# The first estimate of a machine's costs (speculative/cost.estimate_steps): rounds drafting
# 0, 1, 2, 4 and 8 tokens (the draft model's verdict is read at up to MAX_GAMMA) and a
# 64-row batch (free drafts), three samples each; seconds instead of the table's minutes
ESTIMATE_SIZES = (1, 2, 3, 5, 9)
ESTIMATE_LONG = (64,)
ESTIMATE_REPEATS = 3
SCREEN_CONTEXT = 128       # tokens cached before a variant's timed decodes (the table's first)
SCREEN_TOKENS = 8          # draft decodes a timing sample
SCREEN_REPEATS = 5         # samples a variant (the median is kept)
HISTORY_MAX_TOKENS = 200_000   # the opt-in history store: ~800 KB, its trie ~0.5 s to build
# the x86 kernels of a one-token decode (engine/decode_kernels.py): the read-ahead distance
# tried (the best on the Zen 3 it was written on), and the gain a kernel switch must show
# over off to be kept, so that noise does not turn on what a machine gains nothing from
READ_AHEAD_BYTES = 4608
DECODE_KERNEL_MARGIN = 0.02
# the row kernels on prompt batches (engine/prompt_kernels.py): the batch timed (above the
# 64 rows of a verification, where the switches start off) and the gain ours must show
PROMPT_KERNEL_ROWS = 128
PROMPT_KERNEL_MARGIN = 0.03

# Untrusted input's budgets: what a model file's chat template and an HTTP client may cost
# before they are refused. A real template renders in milliseconds into a few times its
# messages; a 128k-token context is ~0.5 MB of text, so 8 MiB leaves JSON escapes room.
TEMPLATE_RENDER_S = 2.0
TEMPLATE_MAX_CHARS = 8 << 20
MAX_BODY_BYTES = 8 << 20
HEADER_READ_S = 10.0       # a connection's request headers, whole, from its first byte
BODY_READ_S = 30.0         # a request's body, whole, once its headers are in

# early exit (early_exit/)
THRESHOLD_GRID = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.98, 0.99, 0.995, 0.999)   # calibrated
# the quality targets (--max-exit-error) calibration fits thresholds for; another target
# takes the plan of the loosest of these not above it
EXIT_TARGETS = (0.005, 0.01, 0.02, 0.05, 0.1)
# a plan's exits are accepted where this one-sided confidence bound of their held-out error
# is within the target (0 wrong of 299 exits bounds it at 1%)
EXIT_ERROR_CONFIDENCE = 0.95
LOOP_SPAN, LOOP_REPEATS = 16, 3   # the repetition guard: a block of up to 16, 3 times in a row
PAD_GAP = 30.0             # feature value of a probe with no earlier one (a large gap)


def default_threads() -> int:
    # llama.cpp decode is memory-bound; more than 8 threads rarely helps on a laptop.
    return max(1, min(os.cpu_count() or 1, 8))


@dataclass(frozen=True)
class LoadConfig:
    """How models are loaded and how big their context is."""

    n_ctx: int = N_CTX
    n_batch: int = N_BATCH
    n_threads: int = 0            # 0: default_threads()
    n_gpu_layers: int = 0         # -1: offload every layer (CUDA/Metal builds)
    # map the GGUF file (True) or read the weights into private memory on huge pages
    # (False); None: memory.private_weights decides per model
    mmap: bool | None = None
    # sequences the target's context holds, each of n_ctx tokens in one KV cache (the
    # server's slots, decoded in one batch: engine/slots.py)
    n_seq: int = 1

    def __post_init__(self) -> None:
        if self.n_ctx < 16:
            raise SpeceeError(f"n_ctx must be at least 16, got {self.n_ctx}")
        if self.n_batch < 1:
            raise SpeceeError(f"n_batch must be positive, got {self.n_batch}")
        if not 1 <= self.n_seq <= MAX_SEQ:
            raise SpeceeError(f"the number of sequences must be 1..{MAX_SEQ}, got {self.n_seq}")
        if self.n_threads < 0:
            raise SpeceeError(f"n_threads must be >= 0, got {self.n_threads}")
        cpus = os.cpu_count() or 1
        if self.n_threads > cpus:
            # threads past the CPUs wait for each other at every barrier of every layer:
            # tens of times slower, not faster
            raise SpeceeError(f"{self.n_threads} threads is more than this machine's {cpus} "
                              f"logical CPUs (0 picks a count that suits it)")

    @property
    def threads(self) -> int:
        return self.n_threads or default_threads()


@dataclass(frozen=True)
class SamplingConfig:
    """Token selection. temperature 0 is greedy (argmax), which is deterministic."""

    temperature: float = 0.0
    top_k: int = 0                # 0: whole vocabulary
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise SpeceeError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.seed < 0:
            raise SpeceeError(f"seed must be >= 0, got {self.seed}")
        if self.top_k < 0:
            raise SpeceeError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise SpeceeError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

# Early exit priced on this machine (early_exit/costs.py): each part of an exiting token
# timed against plain tokens after EE_COST_CONTEXT cached tokens, EE_COST_REPEATS rounds;
# a run probes only where the expected token time beats plain by EE_MARGIN (else it decodes
# plainly), with exit rates learned as the answer goes: the calibration's rate counts as
# EE_RATE_PRIOR probes, and the layers are chosen again every EE_REPLAN tokens
EE_COST_CONTEXT = 128
EE_COST_REPEATS = 7
EE_MARGIN = 0.02
EE_RATE_PRIOR = 32
EE_REPLAN = 16
