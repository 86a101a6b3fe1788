"""The speculative cost model: expected speed formula, gamma choice, caching."""
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest

from specee_cpp.config import LoadConfig
from specee_cpp import provenance
from specee_cpp.bindings import kernel_switch, set_kernel_switch
from specee_cpp.errors import SpeceeError
from specee_cpp.engine import draft_attention as attention
from specee_cpp.speculative import cost
from specee_cpp.speculative.mode import SpecOptions, cost_model
from specee_cpp.speculative.cost import CostModel
from specee_cpp.engine.llm import LLM
from tiny_gguf import write_tiny_model

CPU = CostModel(target_batch_s=[1.0, 1.55, 1.78, 2.37, 2.68, 3.23, 4.2, 5.3], draft_token_s=0.6)
GPU = CostModel(target_batch_s=[1.0 + 0.02 * i for i in range(16)], draft_token_s=0.1)


def test_expected_speed_formula():
    assert CPU.expected_tps(0.9, 0) == 1.0
    # gamma 1 at acceptance a: (1 + a) tokens in c + v(2)
    assert CPU.expected_tps(0.8, 1) == pytest.approx(1.8 / (0.6 + 1.55))
    assert CPU.expected_tps(1.0, 2) == pytest.approx(3 / (1.2 + 1.78), rel=1e-6)
    # past the table: its mean cost per added token ((5.3 - 1.0) / 7)
    assert CPU.verify(10) == pytest.approx(5.3 + 4.3 / 7 * 2)
    # a table whose last batch measured cheaper than the one before (16 rows fill the CPU
    # kernels' tiles, 15 do not) does not make longer drafts look cheaper still
    dip = CostModel(target_batch_s=[1.0 + 0.6 * i for i in range(15)] + [8.6], draft_token_s=0)
    assert dip.verify(17) > dip.verify(16) and dip.verify(20) > dip.verify(17)


def test_longer_batches_are_read_from_their_measured_points():
    m = CostModel(target_batch_s=[1.0 + 0.5 * i for i in range(16)], draft_token_s=0,
                  long_sizes=[24, 32, 48], long_batch_s=[10.0, 12.0, 16.0])
    assert m.verify(16) == 8.5 and m.verify(20) == pytest.approx(8.5 + 1.5 * 4 / 8)
    assert m.verify(32) == 12.0 and m.verify(40) == pytest.approx(14.0)
    assert m.verify(64) == pytest.approx(16.0 + 0.25 * 16)      # past the last: its slope
    # interpolated between two contexts like the rest of the table
    other = CostModel(target_batch_s=[2.0 + i for i in range(16)], draft_token_s=0,
                      long_sizes=[24, 32, 48], long_batch_s=[20.0, 24.0, 32.0], context=1000)
    mid = cost.CostTable([replace(m, context=0), other]).at(500)
    assert mid.long_sizes == [24, 32, 48] and mid.verify(32) == pytest.approx(18.0)
    # the whole curve at once (what a free draft's length is chosen over) says the same
    for model in (m, mid, replace(m, long_sizes=[], long_batch_s=[])):
        curve = model.verify_curve(80)
        assert curve == pytest.approx([model.verify(n) for n in range(1, 81)])
        assert curve[15] == model.target_batch_s[15] and len(curve) == 80


def test_gamma_choice_follows_costs_not_thresholds():
    # FACTS: on this CPU the 0.5B draft (0.6 of a token) never pays; on a GPU-like machine
    # with a cheap draft and flat verification, long drafts do
    assert all(CPU.best_gamma(a) == 0 for a in (0.5, 0.7, 0.9, 0.95))
    assert GPU.best_gamma(0.9) >= 4 and GPU.best_gamma(0.3) <= 1
    cheap = CostModel(CPU.target_batch_s, draft_token_s=0.05)
    assert cheap.best_gamma(0.95) >= 1


def test_what_would_pay_agrees_with_the_gamma_choice():
    # the break-even draft cost at an acceptance: a hair cheaper pays, a hair dearer does not
    for a in (0.7, 0.9, 0.95):
        c = CPU.paying_draft_cost(a)
        assert 0 < c < CPU.draft_token_s   # the 0.6 draft is too dear at every one of them
        assert CostModel(CPU.target_batch_s, draft_token_s=0.98 * c).best_gamma(a) >= 1
        assert CostModel(CPU.target_batch_s, draft_token_s=1.02 * c).best_gamma(a) == 0
    # by hand at 0.9: g = 1 gives (1.9 - 1.55) / 1 = 0.35, g = 3 (3.439 - 2.37) / 3 = 0.356
    assert CPU.paying_draft_cost(0.9) == pytest.approx(max(
        ((1 - 0.9 ** (g + 1)) / 0.1 - CPU.verify(g + 1)) / g for g in range(1, 16)))
    # a round's first draft decode at its measured ratio to the others: dearer, less room
    first = replace(CPU, draft_token_s=0.1, draft_first_s=0.2)
    assert first.paying_draft_cost(0.9) < CPU.paying_draft_cost(0.9)
    # verification of two dearer than the two tokens it can bring: nothing pays at 0.5
    assert CostModel([1.0, 2.1, 3.2], draft_token_s=0.01).paying_draft_cost(0.5, 2) < 0
    # the break-even acceptance of a cheap draft: just above it drafting is chosen
    cheap = CostModel(CPU.target_batch_s, draft_token_s=0.1)
    a = cheap.paying_acceptance()
    assert 0.3 < a < 0.95
    assert cheap.best_gamma(a + 0.01) >= 1 and cheap.best_gamma(a - 0.01) == 0
    # a draft that cannot pay even when always right has no such acceptance
    assert CostModel([1.0, 2.1, 3.2], draft_token_s=0.5).paying_acceptance(2) is None


def test_measure_and_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    with LLM(t, draft=d, config=LoadConfig(n_ctx=256, n_batch=32, n_threads=1)) as llm:
        prompt = llm.model.tokenize("the cat sat")
        calls, said = [], []

        def run():
            calls.append(1)
            return cost.measure_table(llm.tgt.seq, llm.dft.seq, prompt, contexts=(64, 400),
                                      repeats=1, progress=said.append)

        table = cost.load_or_measure("pair", run)
        # longer batches for free drafts: those that fit n_batch 32 (24 and 32, not 48/64)
        m = table.points[0]
        assert m.long_sizes == [24, 32] and all(x > 0 for x in m.long_batch_s)
        # 400 does not fit in 256 cells with a 32-token verify: measured at the most that does
        assert [p.context for p in table.points] == [64, 256 - 32 - 1]
        assert len(m.target_batch_s) == cost.N_MAX and m.draft_token_s > 0
        assert llm.tgt.seq.tokens == prompt and llm.dft.seq.tokens == prompt  # left as found
        # a first chat turn waits for this: it says where it is, context by context
        assert said[0] == "context 1/2 (64 tokens): rounds drafting 0 of 15"
        assert said[-1] == "context 2/2 (223 tokens): a batch of 32 (longer free drafts)"
        assert len(said) == 2 * (cost.N_MAX + 2)
        again = cost.load_or_measure("pair", run)
        assert calls == [1] and again == table and again.key == "pair"


def test_costs_are_read_at_the_context_length():
    """Between measured contexts the costs are interpolated, outside them the nearest is
    used, and a cost-aware policy re-reads them as the cache grows (seen failing with
    the context length ignored: the policy kept drafting where a long context made it a loss)."""
    from specee_cpp.speculative import policies

    short = CostModel([1.0 + 0.02 * i for i in range(16)], 0.1, context=128)
    long = CostModel([4.0 + 2.0 * i for i in range(16)], 3.0, context=1024)
    table = cost.CostTable([short, long])
    assert table.at(0) == short and table.at(4096) == long
    mid = table.at(576)
    assert mid.plain == pytest.approx(2.5) and mid.draft_token_s == pytest.approx(1.55)
    assert mid.verify(2) == pytest.approx((1.02 + 6.0) / 2)
    stop = policies.CostAwareStop(model=None, costs=table, bpw=4.85)
    assert not stop.plan_is_plain and stop.can_pay            # cheap drafting at 128 tokens
    assert stop.plan(policies.RoundAt(1000)) == 0 and not stop.can_pay   # none near 1024


def test_cost_model_records_its_machine(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    with LLM(t, draft=d, config=LoadConfig(n_ctx=128, n_batch=32, n_threads=1)) as llm:
        m = cost_model(llm)
    assert m.machine["threads"] == 1 and m.machine["build"] and m.machine["features"]
    assert f"-m{provenance.machine_id(m.machine)}-" in m.key  # another machine: another entry
    assert "threads" in provenance.describe(m.machine)
    # another build on the same CPU is another machine for the cache
    other = dict(m.machine, build="other")
    assert provenance.machine_id(other) != provenance.machine_id(m.machine)
    # the kernel choices measured for the target are part of the key: a table priced with
    # the read-ahead or the one-row kernel on is not one priced with it off
    from specee_cpp.engine.decode_kernels import DecodeKernels

    monkeypatch.delenv(provenance.SWITCH_ENV.format("READ_AHEAD"), raising=False)
    keys = {}
    for one_row, distance in ((0, 0), (0, 4608), (1, 0)):
        with LLM(t, draft=d, config=LoadConfig(n_ctx=128, n_batch=32, n_threads=1)) as llm:
            llm.decode_kernels = DecodeKernels({"ONE_ROW": one_row, "READ_AHEAD": distance},
                                               "as if measured")
            keys[one_row, distance] = cost_model(llm)
    assert keys[0, 0].machine["kernels"].startswith("ONE_ROW=0; READ_AHEAD=0")
    assert keys[0, 4608].machine["kernels"].startswith("ONE_ROW=0; READ_AHEAD=4608")
    assert keys[1, 0].machine["kernels"].startswith("ONE_ROW=1; READ_AHEAD=0")
    assert len({k.key for k in keys.values()}) == 3


def test_measuring_the_table_leaves_no_cells_a_prompt_would_reuse(tmp_path, monkeypatch):
    """The cost context shares a chat prompt's first tokens; cells read in its batches would
    make the next answer's near ties go by the measurement, not by the prompt alone."""
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    with LLM(t, draft=d, config=LoadConfig(n_ctx=128, n_batch=32, n_threads=1)) as llm:
        llm.generate("hello", max_tokens=2, mode="plain")
        assert llm.tgt.seq.tokens
        cost_model(llm)
        assert llm.tgt.seq.tokens == [] and llm.dft.seq.tokens == []


class _Clocked:
    """A sequence whose decodes advance a fake clock: a batch of n costs ``cost(n)`` plain
    tokens, times the machine's current slowness (``drift``, by the clock)."""

    def __init__(self, clock, cost, drift, n_ctx=2048, n_batch=512):
        self.clock, self.cost, self.drift = clock, cost, drift
        self.ctx = type("Ctx", (), {"n_ctx": n_ctx, "n_batch": n_batch})()
        self.tokens: list[int] = []

    def _run(self, n):
        self.clock[0] += self.cost(n) * self.drift(self.clock[0])

    def prefill(self, tokens, read=True):
        self.tokens = list(tokens)

    def decode(self, tokens, all_outputs=False):
        self._run(len(tokens))
        self.tokens += list(tokens)

    def decode_greedy(self, tokens):
        self.decode(tokens, all_outputs=True)
        return [0] * len(tokens)

    def feed(self, tokens, all_logits=False):
        self.decode(tokens)

    def argmax(self, i=-1):
        return 0

    def confidence(self, i=-1):
        return 0, 1.0, 0.0

    def rewind(self, n):
        del self.tokens[n:]


def test_measure_pairs_each_sample_with_a_plain_reference():
    """The machine slows down threefold half-way through the measurement (a shared machine
    drifts): each batch's cost in plain tokens must still come out right, because it is
    timed against a plain token timed just before it. Timing plain tokens first and batches
    later (measurement version 7) read verify(16) here as ~3x too dear."""
    now = [0.0]
    t_plain = 0.035
    drift = lambda t: 1.0 if t < 3.0 else 3.0  # noqa: E731
    verify = lambda n: t_plain * (1.0 + 0.45 * (n - 1))  # noqa: E731
    tgt = _Clocked(now, verify, drift)
    dft = _Clocked(now, lambda n: 0.5 * t_plain * n, drift)
    m = cost.measure(tgt, dft, list(range(10)), repeats=5, n_context=128,
                     clock=lambda: now[0])
    for n in (2, 4, 8, 16, 32, 64):
        assert m.verify(n) / m.plain == pytest.approx(verify(n) / t_plain, rel=1e-6)
    assert m.draft_token_s / m.plain == pytest.approx(0.5, rel=1e-6)
    assert tgt.tokens == list(range(10)) and dft.tokens == list(range(10))


def test_a_first_measurement_shows_its_progress_on_the_status_line(tmp_path, monkeypatch):
    from specee_cpp.speculative.mode import cost_model_shown

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    shown = []

    class Status:   # as rich's: a context manager whose text can be updated
        def __init__(self, text):
            shown.append(text)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def update(self, text):
            shown.append(text)

    with LLM(t, draft=d, config=LoadConfig(n_ctx=256, n_batch=32, n_threads=1)) as llm:
        table = cost_model_shown(llm, Status, "costs")
        assert shown[0] == "costs" and len(shown) > 2
        assert shown[1] == "costs: the draft's flash attention, on and off"
        assert all(s.startswith("costs: context ") for s in shown[2:])
        # cached: nothing measured, nothing said past the line itself
        shown.clear()
        assert cost_model_shown(llm, Status, "costs") is table and shown == ["costs"]
    # a status that cannot be updated (the server's, no_status) still gets the table
    from specee_cpp.engine.modes import no_status
    with LLM(t, draft=d, config=LoadConfig(n_ctx=256, n_batch=32, n_threads=1)) as llm:
        assert cost_model_shown(llm, no_status, "costs") == table


def test_cache_writes_are_whole_or_absent(tmp_path, monkeypatch):
    from specee_cpp.paths import write_text_atomic

    path = tmp_path / "costs" / "k.json"
    write_text_atomic(path, "old")
    # a write interrupted after the temporary file was opened leaves the old file and no
    # temporary one behind
    real = type(path).write_text

    def torn(self, text, *a, **k):
        real(self, text[:2], *a, **k)
        raise KeyboardInterrupt

    monkeypatch.setattr(type(path), "write_text", torn)
    with pytest.raises(KeyboardInterrupt):
        write_text_atomic(path, "new text")
    monkeypatch.undo()
    assert path.read_text() == "old" and sorted(p.name for p in path.parent.iterdir()) == ["k.json"]
    write_text_atomic(path, "new text")
    assert path.read_text() == "new text"


ROW_SWITCHES = ("AMX_ROWS", "AMX_FUSED_ROWS", "REPACK_ROWS", "Q6_K_ROWS", "ATTN_ROWS",
                "DOT_ROWS")


def test_a_kernel_switch_set_by_hand_is_another_machine(monkeypatch):
    # a row limit moves the price of verifying a few tokens by up to a third, the read-ahead
    # a plain token by 8-19%: set by hand (read as the library reads it: the leading digits
    # of a value that starts with one) a switch is part of the machine, unset it is not
    for name in ("READ_AHEAD", "ONE_ROW") + ROW_SWITCHES:
        monkeypatch.delenv(provenance.SWITCH_ENV.format(name), raising=False)
    base = provenance.machine(2)
    assert "switches" not in base
    for name in ("READ_AHEAD", "ONE_ROW") + ROW_SWITCHES:
        env = provenance.SWITCH_ENV.format(name)
        for raw, read in (("0", 0), ("8rows", 8), ("64", 64), ("x", None), ("-1", None),
                          (" 8", None)):
            monkeypatch.setenv(env, raw)
            assert provenance.switch_set(name) == read, (name, raw)
            m = provenance.machine(2)
            if read is None:
                assert m == base
            else:
                assert m["switches"] == f"{name}={read}"
                assert provenance.machine_id(m) != provenance.machine_id(base)
                assert f"{name}={read}" in provenance.describe(m)
        monkeypatch.delenv(env)
    monkeypatch.setenv("SPECEE_CPP_Q6_K_ROWS", "1")
    monkeypatch.setenv("SPECEE_CPP_REPACK_ROWS", "0")
    assert provenance.machine(2)["switches"] == "REPACK_ROWS=0, Q6_K_ROWS=1"
    # AMX is the machine's own fact: on, off (--no-amx) or absent
    monkeypatch.setenv(provenance.AMX_ENV, "0")
    assert provenance.amx_switched_off()
    monkeypatch.setenv(provenance.AMX_ENV, "1")
    assert not provenance.amx_switched_off()


def read_switches(env: dict) -> dict:
    """The switches as a fresh process's library starts with them under ``env``."""
    code = ("import json; from specee_cpp.bindings import KERNEL_SWITCHES, kernel_switch; "
            "print(json.dumps({n: kernel_switch(n) for n in KERNEL_SWITCHES}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout)


def test_the_library_reads_its_switches_as_the_package_does():
    from specee_cpp.config import LONG_BATCHES

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECEE_CPP_")}
    if kernel_switch("READ_AHEAD") is None:
        pytest.skip("no kernel switches in this library")
    start = read_switches(env)
    # every batch a verification takes (drafts from the context reach max(LONG_BATCHES)
    # rows) is on the row kernels, whose rows equal one-token decodes bit for bit; the
    # read-ahead is off until measured; AMX, where compiled in, is on
    assert all(start[n] >= max(LONG_BATCHES) for n in ("AMX_FUSED_ROWS", "REPACK_ROWS",
                                                       "Q6_K_ROWS", "ATTN_ROWS",
                                                       "DOT_ROWS")), start
    assert start["READ_AHEAD"] == 0 and start["ONE_ROW"] == 0
    assert start["AMX"] == 1 and start["AMX_ROWS"] >= 1
    hand = {"SPECEE_CPP_Q6_K_ROWS": "8rows", "SPECEE_CPP_REPACK_ROWS": "x",
            "SPECEE_CPP_READ_AHEAD": "1024", "SPECEE_CPP_AMX": "0", "SPECEE_CPP_AMX_ROWS": "-3"}
    got = read_switches(dict(env, **hand))
    for name in ("Q6_K_ROWS", "REPACK_ROWS", "READ_AHEAD", "AMX", "AMX_ROWS"):
        with pytest.MonkeyPatch.context() as m:
            m.setenv(provenance.SWITCH_ENV.format(name), hand[f"SPECEE_CPP_{name}"])
            want = provenance.switch_set(name)
        assert got[name] == (start[name] if want is None else want), (name, got, start)


def test_kernel_switches_refuse_unknown_names_and_negative_values():
    if kernel_switch("READ_AHEAD") is None:
        pytest.skip("no kernel switches in this library")
    with pytest.raises(SpeceeError, match="unknown kernel switch 'PREFETCH'"):
        kernel_switch("PREFETCH")
    with pytest.raises(SpeceeError, match="-1 is not a value"):
        set_kernel_switch("Q6_K_ROWS", -1)
    before = kernel_switch("Q6_K_ROWS")
    try:
        set_kernel_switch("Q6_K_ROWS", 5)
        assert kernel_switch("Q6_K_ROWS") == 5
    finally:
        set_kernel_switch("Q6_K_ROWS", before)


def test_doctor_says_what_each_row_kernel_takes_and_where_that_came_from(monkeypatch,
                                                                          tmp_path):
    from specee_cpp.doctor import amx_state, decode_kernel_state, row_kernels
    from specee_cpp.engine.prompt_kernels import EVERY_BATCH

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    for name in ("READ_AHEAD", "ONE_ROW", "AMX") + ROW_SWITCHES:
        monkeypatch.delenv(provenance.SWITCH_ENV.format(name), raising=False)
    live = {"AMX_ROWS": 4, "AMX_FUSED_ROWS": 64, "REPACK_ROWS": 64, "Q6_K_ROWS": 64,
            "ATTN_ROWS": 64, "DOT_ROWS": 64}.get
    x86 = row_kernels("AVX2 = 1 | REPACK = 1", live)
    assert [line.split(" ")[0] for line in x86] == ["REPACK_ROWS", "Q6_K_ROWS", "ATTN_ROWS",
                                                    "DOT_ROWS"]
    assert all("batches of 2-64 rows, library default" in line for line in x86)
    assert "until measured" in x86[0] and "until measured" not in x86[2]
    amx = row_kernels("AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1", live)
    assert [line.split(" ")[0] for line in amx] == ["AMX_ROWS", "AMX_FUSED_ROWS", "ATTN_ROWS",
                                                    "DOT_ROWS"]
    assert "batches of 2-4 rows" in amx[0]
    monkeypatch.setenv("SPECEE_CPP_Q6_K_ROWS", "0")
    q6k = row_kernels("AVX2 = 1", {"Q6_K_ROWS": 0}.get)
    assert "off: upstream's kernels, set by hand (SPECEE_CPP_Q6_K_ROWS)" in q6k[0]
    assert "every batch" in row_kernels("AVX2 = 1", {"Q6_K_ROWS": EVERY_BATCH}.get)[0]
    assert "not in this build" in row_kernels("AVX2 = 1", {}.get)[0]
    # the x86 row kernels only where the build has them; attention and the dots on every CPU
    assert [line.split(" ")[0] for line in row_kernels("NEON = 1", live)] == ["ATTN_ROWS",
                                                                             "DOT_ROWS"]
    monkeypatch.setenv(provenance.AMX_ENV, "0")
    assert "off (SPECEE_CPP_AMX=0" in amx_state("AMX_INT8 = 1")
    # with AMX off the repacked kernels take the weights again
    assert row_kernels("AVX2 = 1 | AMX_INT8 = 1 | REPACK = 1", live)[0].startswith("REPACK")
    # the decode kernels: off until measured, AMX's own where it decodes the Q4_K weights
    assert decode_kernel_state("AVX2 = 1", "ONE_ROW", 0).startswith("off until measured")
    assert decode_kernel_state("AVX2 = 1 | AMX_INT8 = 1", "ONE_ROW", 0).startswith(
        "off until measured")                                  # AMX switched off (above)
    monkeypatch.delenv(provenance.AMX_ENV)
    assert decode_kernel_state("AVX2 = 1 | AMX_INT8 = 1", "ONE_ROW", 0).startswith(
        "not used: AMX")
    monkeypatch.setenv("SPECEE_CPP_ONE_ROW", "1")
    assert decode_kernel_state("AVX2 = 1", "ONE_ROW", 1).startswith("on, set by hand")
    monkeypatch.setenv("SPECEE_CPP_READ_AHEAD", "4608")
    assert decode_kernel_state("AVX2 = 1", "READ_AHEAD", 4608).startswith(
        "4608 bytes ahead, set by hand")
    monkeypatch.setenv("SPECEE_CPP_READ_AHEAD", "0")
    assert decode_kernel_state("AVX2 = 1", "READ_AHEAD", 0).startswith("off, set by hand")
    assert "missing" in decode_kernel_state("AVX2 = 1", "READ_AHEAD", None)
    assert decode_kernel_state("NEON = 1", "READ_AHEAD", 4608).startswith("not used")


def test_the_draft_runs_with_the_attention_its_cost_table_chose(tmp_path, monkeypatch):
    """The draft's flash attention is timed on and off before its costs (the cheaper one
    chosen, the costs measured with it), kept in the cached table, and applied to the draft's
    context whenever the table is read: from the cache too (a second LLM on the pair)."""
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    seen = {"contexts": [128, 255], "default": [2e-3, 3e-3], "off": [1e-3, 2e-3]}
    asked = []

    def timed(model, n_threads, tokens, contexts, n_batch):   # the step-wise timing
        asked.append((list(contexts), n_batch))
        yield "a decode"
        return dict(seen, contexts=list(contexts))

    monkeypatch.setattr(attention, "time_attention_steps", timed)
    cfg = LoadConfig(n_ctx=256, n_batch=32, n_threads=1)
    with LLM(t, draft=d, config=cfg) as llm:
        assert llm.dft.ctx.flash_attn is None               # llama.cpp's default until measured
        table = cost_model(llm)
        # the table's contexts, in contexts of its own (the draft's holds 256 tokens)
        assert asked == [([128, 1024], 32)]
        assert table.draft_flash_attn is False
        assert table.draft_attention == dict(seen, contexts=[128, 1024])
        assert llm.draft_flash_attn is False and llm.dft.ctx.flash_attn is False
        llm.release_draft()
        assert llm.dft.ctx.flash_attn is False              # loaded again: still off
    with LLM(t, draft=d, config=cfg) as llm:                 # from the cache: nothing timed
        assert cost_model(llm).draft_flash_attn is False and len(asked) == 1
        assert llm.dft.ctx.flash_attn is False
    # where flash attention was as cheap, llama.cpp's default stays
    seen["off"] = [2e-3, 3e-3]
    fa, _ = attention.choose(None, 1, [1, 2], n_batch=64)
    assert fa is None and asked[-1] == ([128, 1024], 64)


def test_every_mode_that_drafts_runs_with_the_measured_attention(tmp_path, monkeypatch):
    """Early exit's draft provider, spec with a fixed gamma and spec-ee read no cost table,
    yet decode the draft (ee: on every token): the draft's attention is chosen for them too,
    measured once per draft file and machine and cached on disk."""
    from specee_cpp.early_exit.mode import candidates

    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    t = write_tiny_model(tmp_path / "t.gguf", seed=1)
    d = write_tiny_model(tmp_path / "d.gguf", seed=2)
    asked = []

    def timed(model, n_threads, tokens, contexts, n_batch):
        asked.append(1)
        yield "a decode"
        return {"contexts": list(contexts), "default": [2e-3, 5e-3], "off": [2e-3, 3e-3]}

    monkeypatch.setattr(attention, "time_attention_steps", timed)
    cfg = LoadConfig(n_ctx=256, n_batch=32, n_threads=1)
    with LLM(t, draft=d, config=cfg) as llm:
        candidates(llm, "draft")
        assert llm.dft.ctx.flash_attn is False and asked == [1]
        assert attention.draft_attention(llm)[0] is False and asked == [1]   # kept with the LLM
    with LLM(t, draft=d, config=cfg) as llm:                 # a new process: from the disk
        out = llm.generate("the cat", max_tokens=4, mode="spec", options=SpecOptions(gamma=2))
        assert out.stats.n_drafted > 0 and llm.dft.ctx.flash_attn is False and asked == [1]


def test_attention_is_timed_both_ways_at_each_context(tmp_path):
    """The real timing on a tiny model: both settings, each context, positive seconds; the
    caches are its own (the model can be timed while a context of it is open)."""
    from specee_cpp.bindings import Model

    model = Model(write_tiny_model(tmp_path / "t.gguf", seed=1))
    try:
        seen = attention.time_attention(model, 1, [5, 6, 7], contexts=(40, 8), n_batch=16,
                                   decodes=3, warmup=1)
        # step by step (idle-time slices): each cache fill and each timed decode one step
        steps = attention.time_attention_steps(model, 1, [5, 6, 7], contexts=(40, 8),
                                               n_batch=16, decodes=3, warmup=1)
        n = 0
        while True:
            try:
                next(steps)
                n += 1
            except StopIteration as done:
                assert set(done.value) == {"contexts", "default", "off"}
                break
    finally:
        model.close()
    # fills: 8 tokens, then 32 more in two batches of 16, each of the two contexts; decodes:
    # (1 + 3) turns x 2 settings at each of the two contexts
    assert n == 2 * (1 + 2) + 2 * 4 * 2
    assert seen["contexts"] == [8, 40]
    assert len(seen["default"]) == len(seen["off"]) == 2
    assert all(x > 0 for x in seen["default"] + seen["off"])


def test_verification_learned_dearer_than_the_table_is_priced_so():
    """VerifyScale: batches that run 20% over the table while plain steps run as measured are
    priced ~20% dearer (shrunk while few were seen); a machine slower all round keeps its
    table; the plain token, the unit, is never scaled; long batches learn apart."""
    c = CostModel([1.0 + 0.5 * i for i in range(16)], 0.3, long_sizes=[32, 64],
                  long_batch_s=[12.0, 20.0])
    dear, slow = cost.VerifyScale(), cost.VerifyScale()
    assert dear.apply(c) is c and dear.factor(3) == 1.0           # nothing seen: the table
    for _ in range(40):
        dear.observe(c, 1, c.plain)
        dear.observe(c, 3, 1.2 * c.verify(3))
        slow.observe(c, 1, 1.3 * c.plain)
        slow.observe(c, 5, 1.3 * c.verify(5))
    assert 1.12 < dear.factor(3) < 1.2 and dear.factor(1) == 1.0
    assert slow.factor(5) == pytest.approx(1.0, abs=0.01)
    assert dear.factor(32) == pytest.approx(1.0)                  # no long batch seen
    scaled = dear.apply(c)
    assert scaled.plain == c.plain and scaled.verify(3) == pytest.approx(
        c.verify(3) * dear.factor(3), rel=1e-3)                   # factors kept to 3 places
    assert scaled.verify(64) == c.verify(64) and dear.apply(c) is scaled
    one = cost.VerifyScale()
    one.observe(c, 3, 100.0 * c.verify(3))      # one burst: clipped, and shrunk by the prior
    assert one.factor(3) < 1.1
    plain_only = cost.VerifyScale()             # a policy that never drafted: no batch seen
    for _ in range(40):
        plain_only.observe(c, 1, 1.3 * c.plain)
    assert plain_only.factor(3) == pytest.approx(1.0) and plain_only.apply(c) is c


def test_scaled_costs_multiply_the_batches_and_keep_the_unit():
    """CostModel.scaled / CostTable.scaled (a replay's timing where real verification runs
    dearer than the table): batches of 2..MAX_VERIFY rows by the first factor, longer ones by
    the second, the plain token and the draft kept, every point of a table alike."""
    c = CostModel([1.0 + 0.5 * i for i in range(16)], 0.3, long_sizes=[16, 32, 64],
                  long_batch_s=[8.5, 12.0, 20.0], context=128)
    s = c.scaled(1.2, 1.5)
    assert s.plain == c.plain and s.draft(3) == c.draft(3)
    assert s.verify(1) == c.verify(1) and s.verify(4) == pytest.approx(1.2 * c.verify(4))
    assert s.long_batch_s == pytest.approx([8.5 * 1.2, 12.0 * 1.5, 20.0 * 1.5])
    assert c.scaled(1.2).long_batch_s == pytest.approx([8.5 * 1.2, 12.0 * 1.2, 20.0 * 1.2])
    table = cost.CostTable([c, replace(c, context=1024, plain_token_s=2.0)])
    st = table.scaled(2.0)
    assert [p.context for p in st.points] == [128, 1024]
    assert st.at(500).verify(3) == pytest.approx(2.0 * table.at(500).verify(3))
    assert st.at(500).plain == pytest.approx(table.at(500).plain)


def test_a_first_estimate_times_the_deciding_sizes_and_reads_the_rest_between():
    """The estimate (seconds, where the table takes minutes) times rounds drafting 0/1/2/4/8
    tokens and a 64-row batch, three samples each; every other size is read linearly between
    them, so on a machine whose batches grow linearly it prices every size as the full
    measurement does, with a small fraction of its samples."""
    from specee_cpp.config import ESTIMATE_LONG, ESTIMATE_SIZES

    now = [0.0]
    t_plain = 0.035
    verify = lambda n: t_plain * (1.0 + 0.5 * (n - 1))  # noqa: E731
    tgt = _Clocked(now, verify, lambda t: 1.0)
    dft = _Clocked(now, lambda n: 0.4 * t_plain * n, lambda t: 1.0)
    state: dict = {}
    n_estimate = sum(1 for _ in cost.estimate_steps(tgt, dft, list(range(10)), state,
                                                    clock=lambda: now[0]))
    assert sorted(map(int, state["batch"])) == list(ESTIMATE_SIZES)
    assert state["long_sizes"] == list(ESTIMATE_LONG)
    m = cost.model_from(state)
    assert len(m.target_batch_s) == cost.N_MAX and m.context == 128
    for n in range(1, 65):
        assert m.verify(n) / m.plain == pytest.approx(verify(n) / t_plain, rel=1e-6), n
    assert m.draft_token_s / m.plain == pytest.approx(0.4, rel=1e-6)
    whole: dict = {}
    n_table = sum(1 for _ in cost.measure_table_steps(tgt, dft, list(range(10)), whole))
    assert n_estimate * 6 < n_table


# what one 2-core VM measured at 1024 tokens of context while other work ran on it: a batch
# of 3 under a plain token, 24 rows at a third of 16 (in plain tokens; sizes 1-16, then 24-64)
BUSY = ([1.19, 2.42, 0.72, 2.8, 3.28, 1.2, 3.74, 3.7, 2.27, 4.56, 3.74, 7.59, 4.66, 6.11, 5.56,
         5.7], [1.76, 5.68, 5.84, 13.6])
# the same pair at 128 tokens a few minutes earlier, undisturbed
QUIET = ([1.01, 1.2, 1.45, 1.65, 2.43, 2.74, 3.19, 2.85, 3.7, 3.81, 4.05, 4.28, 4.87, 4.8, 5.76,
          6.15], [8.72, 11.46, 15.1, 20.88])


def _point(ratios, context):
    return CostModel(target_batch_s=list(ratios[0]), draft_token_s=0.3, plain_token_s=1.0,
                     context=context, long_sizes=[24, 32, 48, 64],
                     long_batch_s=list(ratios[1]))


def test_a_table_with_a_batch_far_under_a_smaller_one_is_implausible():
    assert cost.implausible(_point(QUIET, 128)) is None
    assert cost.implausible(CPU) is None and cost.implausible(GPU) is None
    why = cost.implausible(cost.CostTable([_point(QUIET, 128), _point(BUSY, 1024)]))
    assert why == ("at 1024 tokens of context a batch of 3 measured 0.72 plain tokens, "
                   "a batch of 2 2.42")
    # past the table's sizes too: 24 rows at 1.76 after 16 at 5.70
    later = (QUIET[0], [1.76] + QUIET[1][1:])
    assert "a batch of 24 measured 1.76" in cost.implausible(_point(later, 128))
    # a dip within what undisturbed tables show (16 rows cheaper than 15) is no sign
    assert cost.implausible(_point((QUIET[0][:15] + [0.8 * QUIET[0][14]], QUIET[1]), 128)) \
        is None


class _Busy(_Clocked):
    """A _Clocked target whose first ``slow`` one-token decodes take 5 times as long: a
    neighbour busy while the plain references are timed and gone for the batches."""

    def __init__(self, *args, slow: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow = slow

    def _run(self, n):
        super()._run(n)
        if n == 1 and self.slow > 0:
            self.slow -= 1
            self.clock[0] += 4 * self.cost(n) * self.drift(self.clock[0])


def test_a_disturbed_measurement_is_taken_again_and_the_median_kept(tmp_path, monkeypatch):
    """The first measurement's plain references are slowed (batches of 2-4 read at a fifth
    of what they cost): the table is measured twice more, and the median of the three is
    what the batches cost. Undisturbed, one measurement is taken; a table still implausible
    after its repeats prices the run without being cached."""
    now = [0.0]
    t_plain = 0.035
    verify = lambda n: t_plain * (1.0 + 0.45 * (n - 1))  # noqa: E731
    steady = lambda t: 1.0  # noqa: E731
    far = lambda table: 2.0  # noqa: E731   # the draft model's verdict: not near its threshold
    runs = {}
    for name, slow in (("quiet", 0), ("busy", 40)):   # 20 plain steps, then 20 references
        tgt = _Busy(now, verify, steady, slow=slow)
        dft = _Clocked(now, lambda n: 0.5 * t_plain * n, steady)
        state: dict = {}
        list(cost.steady_table_steps(tgt, dft, list(range(10)), state, far,
                                     clock=lambda: now[0]))
        runs[name] = state
    assert "again" not in runs["quiet"]
    first = cost.table_from({"points": runs["busy"]["points"]})
    assert cost.implausible(first).startswith("at 128 tokens of context a batch of 2 measured")
    assert len(runs["busy"]["again"]) == cost.STEADY_RUNS - 1
    table = cost.table_from(runs["busy"])
    assert cost.implausible(table) is None
    for m in table.points:
        for n in (2, 3, 4, 8, 16, 64):
            assert m.verify(n) / m.plain == pytest.approx(verify(n) / t_plain, rel=1e-6)
    # kept only where it is plausible
    monkeypatch.setenv("SPECEE_CPP_HOME", str(tmp_path))
    keep = lambda t: cost.implausible(t) is None  # noqa: E731
    got = cost.load_or_measure("busy", lambda: first, keep=keep)
    assert got.key == "busy" and got.points[0].target_batch_s == first.points[0].target_batch_s
    assert not cost.cache_path("busy").exists()
    assert cost.load_or_measure("quiet", lambda: table, keep=keep) == cost.load_cached("quiet")
