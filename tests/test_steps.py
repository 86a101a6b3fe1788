"""The stream wrapper on a scripted strategy: text, stop conditions, statistics."""
from specee_cpp.engine.steps import Step, stream

# token id -> bytes; 9 is end-of-generation; 5+6 split one UTF-8 character (é = c3 a9)
PIECES = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xc3", 6: b"\xa9", 7: b"!", 9: b""}


def run(tokens, **kw):
    def strategy():
        for i, t in enumerate(tokens):
            yield Step(token=t, timings={"prefill": 0.5} if i == 0 else {"decode": 0.1},
                       n_drafted=2, n_accept=1, exit_layer=3 if t == 2 else None)
    kw.setdefault("max_tokens", 100)
    return list(stream(strategy(), piece=PIECES.__getitem__, is_eog=lambda t: t == 9,
                       n_prompt=4, **kw))


def test_text_and_eog():
    steps = run([1, 2, 3, 4, 9, 1])
    assert "".join(s.text for s in steps) == "Hello world"
    last = steps[-1]
    assert last.token == 9 and last.finish_reason == "stop" and last.text == ""
    assert [s.finish_reason for s in steps[:-1]] == [None] * 4
    st = last.stats
    assert (st.n_prompt, st.n_gen, st.n_drafted, st.n_accept) == (4, 4, 10, 5)
    # the first token came from the prefill; the end-of-generation token took a pass
    assert st.n_decode == 4
    assert st.prefill_s == 0.5 and st.timings["decode"] == 0.4
    assert st.exit_layers == {3: 1}
    # five rounds of 2 drafted, 1 accepted: position 0 always accepted, position 1 never
    assert st.accept_by_pos == [[5, 5], [5, 0]]
    assert st.as_dict()["acceptance_by_position"] == [1.0, 0.0]


def test_max_tokens():
    steps = run([1, 2, 3, 4], max_tokens=2)
    assert len(steps) == 2 and steps[-1].finish_reason == "length"
    assert steps[-1].stats.n_decode == 1     # the prefill's token is not a decode
    assert "".join(s.text for s in steps) == "Hello"


def test_utf8_split_across_tokens():
    steps = run([1, 5, 6, 7, 9])
    assert [s.text for s in steps] == ["Hel", "", "é", "!", ""]


def test_stop_string_held_back_and_cut():
    steps = run([1, 2, 3, 4, 7], stop=("o w",))
    text = "".join(s.text for s in steps)
    assert text == "Hell" and steps[-1].finish_reason == "stop_string"


def test_a_stop_string_spelled_out_in_short_pieces_is_found():
    """Pieces shorter than the stop string (digits one token each; HumanEval's
    "\nif __name__" after a short line): the text held back is never released early, so
    the stop string is found however the pieces split it (54 of 1376 HumanEval answers in
    docs/bench ran past a stop string before this was fixed)."""
    digits = {i: str(i % 10).encode() for i in range(10, 40)}

    def strategy():
        for t in range(11, 40):
            yield Step(token=t)
    for stop in ("4567", "1234", "8901", "9012", "56789012345"):
        steps = list(stream(strategy(), piece=digits.__getitem__, is_eog=lambda t: False,
                            n_prompt=1, max_tokens=100, stop=(stop,)))
        text = "".join(s.text for s in steps)
        assert steps[-1].finish_reason == "stop_string", stop
        full = "".join(str(t % 10) for t in range(11, 40))
        assert text == full[:full.index(stop)], stop


def test_an_output_that_ends_inside_a_round_counts_the_round():
    """The end of generation or a stop string among a round's drafted tokens: the round's
    counts, which its last step carries, are read (computed already), and nothing after it.
    A token that is not a drafted one, even without timings (early exit's token from its
    check's second row), ends the output where it stands: the next would cost a decode."""
    read = []

    def strategy():
        rounds = [([1], 0, 0), ([2, 3, 4], 3, 2), ([9, 7, 1], 4, 2), ([2], 0, 0)]
        for i, (tokens, drafted, accepted) in enumerate(rounds):
            for t in tokens[:-1]:                 # drafted tokens: no timings
                read.append(t)
                yield Step(token=t, drafted=True)
            read.append(tokens[-1])
            yield Step(token=tokens[-1], timings={"prefill" if i == 0 else "verify": 0.1},
                       n_drafted=drafted, n_accept=accepted, source="context")

    # "o w" ends in round 2's second token; the end of generation is round 3's first
    for stop, counts, n_decode, upto in (((), (7, 4), 4, 7), (("o w",), (3, 2), 2, 4)):
        read.clear()
        steps = list(stream(strategy(), piece=PIECES.__getitem__, is_eog=lambda t: t == 9,
                            n_prompt=4, max_tokens=100, stop=stop))
        st = steps[-1].stats
        assert st.finish_reason == ("stop_string" if stop else "stop")
        assert (st.n_drafted, st.n_accept) == counts and st.by_source == {"context": [*counts]}
        assert st.n_decode == n_decode and read == [1, 2, 3, 4, 9, 7, 1][:upto], stop

    def early_exit():
        for t in (1, 2, 9, 3, 4):
            read.append(t)
            yield Step(token=t, timings={} if t == 9 else {"decode": 0.1},
                       n_drafted=int(t == 2), n_accept=int(t == 2), source="exit")
    read.clear()
    st = list(stream(early_exit(), piece=PIECES.__getitem__, is_eog=lambda t: t == 9,
                     n_prompt=4, max_tokens=100))[-1].stats
    assert read == [1, 2, 9] and (st.n_drafted, st.n_accept) == (1, 1)


def test_stop_string_not_matched_releases_everything():
    steps = run([1, 2, 3, 4, 9], stop=("xyz",))
    assert "".join(s.text for s in steps) == "Hello world"


def test_closing_the_stream_closes_the_strategy():
    closed = []

    def strategy():
        try:
            while True:
                yield Step(token=1)
        finally:
            closed.append(True)

    s = stream(strategy(), piece=PIECES.__getitem__, is_eog=lambda t: False, n_prompt=1,
               max_tokens=10)
    next(s)
    s.close()
    assert closed == [True]
