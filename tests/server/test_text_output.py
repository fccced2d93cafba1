"""server/text_output.py: the text of a sequence as its tokens arrive (incremental detokenization, stop
tokens and stop strings, what a stream holds back), with the bundled tiny model's byte-level tokenizer."""

from __future__ import annotations

import random

import pytest

from asyncgrpo.modeling.load import load_tokenizer
from asyncgrpo.server.text_output import TextOutput

EOS = 484  # <|im_end|>


@pytest.fixture(scope="module")
def decode():
    tokenizer = load_tokenizer("asyncgrpo/tiny-chat")
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _streamed(out: TextOutput, tokens: list[int], step: int) -> str:
    text = ""
    for i in range(0, len(tokens), step):
        out.add(tokens[i : i + step])
        text += out.delta()
    return text + out.delta(final=True)


@pytest.mark.parametrize("step", [1, 3])
def test_streamed_deltas_add_up_to_decoding_every_token_at_once(decode, step):
    rng = random.Random(step)
    for _ in range(20):
        tokens = [rng.randrange(482) for _ in range(rng.randrange(1, 40))]
        out = TextOutput(decode, frozenset({EOS}))
        assert _streamed(out, tokens, step) == decode(tokens) == out.text
        assert out.num_tokens == len(tokens) and not out.stopped


def test_the_stop_tokens_text_is_left_out_but_the_token_is_counted(decode):
    tokens = [17, 378, 220, 18, EOS]
    for incremental in (True, False):
        out = TextOutput(decode, frozenset({EOS, 18}), incremental=incremental)
        out.add(tokens)
        assert out.finish() == decode([17, 378, 220]) and out.num_tokens == 5


def test_a_stop_string_cuts_the_text_and_keeps_the_tokens_up_to_the_one_completing_it(decode):
    tokens = [17, 378, 220, 18, 377, 220, 21, 13]  # "2 + 3 = 6."
    assert decode(tokens) == "2 + 3 = 6."
    out = TextOutput(decode, frozenset(), stop=("3 =",))
    out.add(tokens)
    assert (out.text, out.stop_string, out.num_tokens) == ("2 + ", "3 =", 5)
    kept = TextOutput(decode, frozenset(), stop=("3 =", "+"), include_stop_str=True)
    kept.add(tokens)
    assert (kept.finish(), kept.stop_string, kept.num_tokens) == ("2 +", "+", 2)  # the earliest string


def test_a_stream_holds_back_what_may_start_a_stop_string(decode):
    out = TextOutput(decode, frozenset(), stop=("= 7",))
    sent = ""
    for token in [17, 378, 220, 18, 377]:  # "2 + 3 ="
        out.add([token])
        sent += out.delta()
    assert (sent, out.text) == ("2 + 3", "2 + 3 =")  # " =" could still become "= 7"
    out.add([220, 21, 13])  # " 6."
    assert out.delta() == " = " and not out.stopped  # the last 2 characters wait for the next token
    assert out.delta(final=True) == "6."
