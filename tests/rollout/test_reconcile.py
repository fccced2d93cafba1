import random

import pytest

from asyncgrpo.rollout.reconcile import common_prefix_length, reconcile_turns
from asyncgrpo.types import TurnRecord


def turn(prompt, outputs, first_logprob=-1.0, **kwargs):
    """A turn whose output log-probs are distinct values, so each generated token is identifiable."""
    logprobs = [first_logprob - 0.01 * i for i in range(len(outputs))]
    return TurnRecord(prompt_ids=list(prompt), output_ids=list(outputs), output_log_probs=logprobs, **kwargs)


def trained(seq):
    return [(t, lp) for t, m, lp in zip(seq.token_ids, seq.trained_mask, seq.sampler_logprobs) if m]


def test_clean_chain_extends_one_sequence():
    t1 = turn([1, 2, 3], [10, 11, 99], -1.0)
    t2 = turn([1, 2, 3, 10, 11, 99, 50, 51], [12, 13], -2.0)  # + tool result 50 51
    result = reconcile_turns([t1, t2])
    assert len(result.sequences) == 1
    (seq,) = result.sequences
    assert seq.token_ids == [1, 2, 3, 10, 11, 99, 50, 51, 12, 13]
    assert seq.trained_mask == [0, 0, 0, 1, 1, 1, 0, 0, 1, 1]
    assert (seq.sampler_logprobs[3:6] == t1.output_log_probs
            and seq.sampler_logprobs[8:] == t2.output_log_probs)
    assert (result.num_transitions, result.num_forks, result.drift_tokens) == (1, 0, [0])


def test_rewritten_history_forks_with_the_full_prompt_as_context():
    # turn 1 thought "<think> 20 21 </think>" is dropped from the re-rendered history of turn 2
    t1 = turn([1, 2], [20, 21, 22, 30, 99], -1.0)
    t2 = turn([1, 2, 30, 99, 50], [31, 99], -2.0)
    result = reconcile_turns([t1, t2])
    assert [s.token_ids for s in result.sequences] == [[1, 2, 20, 21, 22, 30, 99], [1, 2, 30, 99, 50, 31, 99]]
    assert result.sequences[1].trained_mask == [0, 0, 0, 0, 0, 1, 1]
    assert result.num_forks == 1
    assert result.drift_tokens == [7 - 2]  # held 7 tokens, 2 shared


def test_divergence_inside_the_last_response_counts_only_the_rerendered_tail():
    t1 = turn([1, 2, 3], [10, 11, 12, 13], -1.0)
    t2 = turn([1, 2, 3, 10, 11, 77, 13, 5], [14], -2.0)  # tokens 12 13 re-tokenized as 77 13
    result = reconcile_turns([t1, t2])
    assert result.drift_tokens == [2]
    assert len(result.sequences) == 2
    assert trained(result.sequences[1]) == [(14, -2.0)]


def test_divergence_before_the_last_response():
    t1 = turn([1, 2, 3, 4], [10, 11], -1.0)
    t2 = turn([1, 8, 3, 4, 10, 11, 5], [12], -2.0)  # system prompt re-rendered
    result = reconcile_turns([t1, t2])
    assert result.drift_tokens == [6 - 1]
    assert result.sequences[1].token_ids == [1, 8, 3, 4, 10, 11, 5, 12]


def test_turn_without_output_tokens_extends_and_adds_nothing_trained():
    t1 = turn([1, 2], [10], -1.0)
    t2 = turn([1, 2, 10, 5], [])
    t3 = turn([1, 2, 10, 5, 6], [11], -2.0)
    result = reconcile_turns([t1, t2, t3])
    assert [s.token_ids for s in result.sequences] == [[1, 2, 10, 5, 6, 11]]
    assert result.drift_tokens == [0, 0]


def test_rollout_without_trained_tokens_yields_no_sequence():
    assert reconcile_turns([turn([1, 2], [])]).sequences == []
    assert reconcile_turns([turn([1, 2], [3, 4], output_mask=[0, 0])]).sequences == []
    assert reconcile_turns([]).num_transitions == 0


def test_fork_with_zero_output_then_extension_trains_in_the_new_sequence():
    t1 = turn([1, 2], [10], -1.0)
    t2 = turn([1, 3], [])  # fork with nothing generated
    t3 = turn([1, 3, 4], [11], -2.0)
    result = reconcile_turns([t1, t2, t3])
    assert [s.token_ids for s in result.sequences] == [[1, 2, 10], [1, 3, 4, 11]]
    assert result.num_forks == 1 and result.drift_tokens == [2, 0]


def test_masked_outputs_stay_context():
    t1 = turn([1], [10, 11, 12], -1.0, output_mask=[1, 0, 1])
    (seq,) = reconcile_turns([t1]).sequences
    assert seq.trained_mask == [0, 1, 0, 1]
    assert seq.sampler_logprobs[2] == 0.0


def test_top_logprobs_and_candidates_align_with_trained_tokens():
    t1 = TurnRecord([1], [10, 11], [-0.1, -0.2], output_sampling_mask=[[10, 12], [11]],
                    output_sampler_logprobs=[{10: -0.1, 12: -2.0}, {11: -0.2}])
    t2 = turn([1, 10, 11, 5], [13], -3.0)
    (seq,) = reconcile_turns([t1, t2]).sequences
    assert seq.sampler_topk == [None, {10: -0.1, 12: -2.0}, {11: -0.2}, None, None]
    assert seq.candidate_sets == [None, [10, 12], [11], None, None]
    (plain,) = reconcile_turns([t2]).sequences
    assert plain.sampler_topk is None and plain.candidate_sets is None


def test_errors_name_the_rollout_and_turn():
    with pytest.raises(ValueError, match="rollout abc, turn 1: output_log_probs"):
        reconcile_turns([turn([1], [2]), TurnRecord([1, 2, 3], [4])], rollout_id="abc")
    with pytest.raises(ValueError, match="empty prompt_ids"):
        reconcile_turns([turn([], [2])])


def test_every_generated_token_is_trained_exactly_once_on_the_context_it_was_sampled_from():
    rng = random.Random(0)
    for trial in range(200):
        turns, history, generated = [], [rng.randrange(100) for _ in range(rng.randint(1, 5))], []
        context_of = {}  # sampler log-prob (a unique id) -> tokens the sampler conditioned on
        for t in range(rng.randint(1, 6)):
            prompt = list(history)
            if t and rng.random() < 0.4:  # re-render: drop or rewrite a random middle slice
                cut = rng.randrange(len(prompt))
                prompt = prompt[:cut] + [rng.randrange(100)
                                         for _ in range(rng.randint(0, 3))] + prompt[cut + 2 :]
            prompt += [rng.randrange(100) for _ in range(rng.randint(0, 3))]  # tool output / template glue
            outputs = [rng.randrange(100) for _ in range(rng.randint(0, 4))]
            mask = [int(rng.random() < 0.9) for _ in outputs]
            rec = turn(prompt or [0], outputs, first_logprob=-(trial * 10 + t) - 1.0, output_mask=mask)
            turns.append(rec)
            generated += [(o, lp) for o, lp, m in zip(outputs, rec.output_log_probs, mask) if m]
            for i, lp in enumerate(rec.output_log_probs):
                context_of[lp] = rec.prompt_ids + outputs[:i]
            history = (prompt or [0]) + outputs
        result = reconcile_turns(turns)
        got = [pair for seq in result.sequences for pair in trained(seq)]
        assert sorted(got) == sorted(generated)
        for seq in result.sequences:
            for j, (m, lp) in enumerate(zip(seq.trained_mask, seq.sampler_logprobs)):
                if m:
                    assert seq.token_ids[:j] == context_of[lp]
        assert len(result.drift_tokens) == result.num_transitions == len(turns) - 1
        assert all(s.num_trained_tokens > 0 for s in result.sequences)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([1, 2], [1, 2]) == 2
