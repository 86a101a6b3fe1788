"""Guard: drafted rounds that run slower than plain send the policy to plain decoding for a
backoff that doubles while probes keep losing.
Seen failing with planted bugs: observe() a no-op; gate() a pass-through; the backoff not
doubled; plain speed not learned from plain steps."""
from specee_cpp.speculative.policies import Guard


def lose(g: Guard, rounds: int, tps: float = 5.0) -> None:
    for _ in range(rounds):
        g.observe(n_drafted=3, tokens=int(tps), seconds=1.0)


def gated_steps(g: Guard, limit: int = 10_000) -> int:
    """Steps the guard keeps the policy at plain decoding before letting it draft again."""
    n = 0
    while g.gate(4) == 0:
        n += 1
        assert n < limit
    return n


def test_slow_drafted_rounds_back_off_and_the_backoff_doubles():
    g = Guard(plain_tps_prior=10.0, window=4, first_backoff=16, max_backoff=64)
    lose(g, 3)
    assert g.gate(4) == 4                # fewer than `window` rounds: no verdict yet
    lose(g, 1)
    assert g.gate(4) == 0                # the 4-round average (5 tok/s) is below plain (10)
    assert 1 + gated_steps(g) == 16      # plain for the whole first backoff
    lose(g, 4)
    assert gated_steps(g) == 32          # the next probe lost too: twice as long
    lose(g, 4)
    assert gated_steps(g) == 64
    lose(g, 4)
    assert gated_steps(g) == 64          # capped


def test_fast_drafted_rounds_never_gate_and_reset_the_backoff():
    g = Guard(plain_tps_prior=10.0, window=4, first_backoff=16)
    lose(g, 4)
    gated_steps(g)
    lose(g, 4, tps=20.0)                 # a winning probe
    for _ in range(50):
        assert g.gate(3) == 3
        g.observe(n_drafted=3, tokens=20, seconds=1.0)
    # losing again: the running average sinks below plain, and the wait is the first backoff
    rounds = 0
    while g.gate(3) != 0:
        lose(g, 1)
        rounds += 1
        assert rounds < 20
    assert 1 + gated_steps(g) == 16


def test_plain_speed_is_learned_from_plain_steps():
    g = Guard(plain_tps_prior=100.0, window=2, first_backoff=8)
    for _ in range(20):
        g.observe(n_drafted=0, tokens=1, seconds=0.25)   # plain really runs at 4 tok/s
    assert abs(g.plain_tps() - 4.0) < 1e-6
    lose(g, 2, tps=5.0)                  # 5 tok/s beats the measured 4, not the prior 100
    assert g.gate(4) == 4


def test_catch_up_is_charged_except_to_the_first_round_after_a_wait():
    """The draft's catch-up on free drafts and chosen plain steps is a cost of drafting with
    the model (charged); the catch-up on the guard's own wait is the wait's, and only the
    first drafted round after it is judged without it."""
    g = Guard(plain_tps_prior=10.0, window=1, first_backoff=8)
    g.observe(n_drafted=3, tokens=4, seconds=0.5, catch_up=0.3)   # 8 tok/s with it
    assert g.gate(4) == 0                                          # charged: lost
    gated_steps(g)
    g.observe(n_drafted=3, tokens=4, seconds=0.5, catch_up=0.3)   # 20 tok/s without it
    assert g.gate(4) == 4                                          # the probe won
    g.observe(n_drafted=3, tokens=4, seconds=0.5, catch_up=0.3)
    assert g.gate(4) == 0                                          # charged again


def test_losing_holds_from_a_verdict_against_drafting_to_the_next_drafted_round():
    g = Guard(plain_tps_prior=10.0, window=2, first_backoff=4)
    lose(g, 1)
    assert not g.losing                  # no verdict yet
    lose(g, 1)
    assert g.losing and g.wait == 4      # the verdict: slower than plain
    for _ in range(4):
        assert g.hold()                  # each call is one step of the wait
    assert not g.hold() and g.losing     # the wait is over; no drafted round yet
    g.observe(n_drafted=0, tokens=1, seconds=0.1)
    assert g.losing                      # a plain step is no probe
    lose(g, 1)
    assert not g.losing                  # a drafted round probed (its verdict comes later)


def test_rounds_are_judged_by_their_tokens_over_their_seconds():
    """Rounds are mostly either fully accepted or cut short; their speed is what they emit
    over the time they take, not the average of each round's rate, which weighs the short
    ones above their share of the time (HumanEval 0-23 on the Zen 5 EPYC: verdicts against
    a model whose rounds ran 1.27x plain, and the model off for most of the next answers)."""
    g = Guard(plain_tps_prior=7.3, window=2, memory=8)
    for i in range(40):
        assert g.gate(3) == 3, f"gated after round {i}"
        if i % 2:
            g.observe(n_drafted=3, tokens=1, seconds=0.25)   # rejected: 4 tok/s
        else:
            g.observe(n_drafted=3, tokens=4, seconds=0.4)    # accepted: 10 tok/s
    # the same rounds, all slow: the sums sink below plain and the guard backs off
    lose(g, 20, tps=4.0)
    assert g.gate(3) == 0


def test_a_longer_memory_outlasts_a_short_run_of_rejected_rounds():
    """The draft model's guard (memory 8) keeps drafting through the three rejected rounds
    that end one answer and start the next; a guard remembering 4 rounds backs off there."""
    def run(memory):
        g = Guard(plain_tps_prior=45.0, window=4, memory=memory)
        for _ in range(12):
            g.observe(n_drafted=3, tokens=4, seconds=0.064)    # 62 tok/s, fully accepted
        for _ in range(3):
            g.observe(n_drafted=3, tokens=1, seconds=0.060)    # 17 tok/s, rejected
        return g.wait > 0   # backed off

    assert run(memory=4)
    assert not run(memory=8)
