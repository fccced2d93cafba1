"""The admission state machine, driven by hand: no processes, no event loop."""

import pytest

from asyncgrpo.rollout.admission import (
    BLOCKED_CONCURRENCY,
    BLOCKED_FIRST_GROUP,
    Admission,
    allowance_after_step,
    initial_allowance,
    is_stale,
    may_start_group,
    on_policy_extension,
    staleness,
)
from asyncgrpo.rollout.channel import IDLE_ON_POLICY, IDLE_STALENESS, TrainerView

CAP = 1_000  # concurrency cap: out of the way unless a test is about it


def run_group(admission: Admission, num_rollouts: int, tokens_per_rollout: int, num_samples: int):
    """One group's whole life: started, generated, scored with `num_samples` samples, closed."""
    started = admission.on_group_started(num_rollouts)
    for _ in range(num_rollouts):
        admission.on_rollout_finished()
    admission.on_generation_ended()
    num_tokens = num_rollouts * tokens_per_rollout
    admission.on_group_generated(num_tokens, num_rollouts)
    if num_samples:
        admission.on_samples_queued(num_tokens)
    admission.on_group_scored(started, num_samples)
    admission.on_group_left_scoring(num_tokens)
    admission.on_group_closed()
    return started


# -- the trainer's formulas ---------------------------------------------------------------------------


def test_initial_allowance_is_max_staleness_steps_of_full_rows_of_every_process():
    assert initial_allowance(num_processes=1, token_budget=100,
                             gradient_accumulation_steps=1, max_staleness=4) == 400
    assert initial_allowance(num_processes=2, token_budget=100, gradient_accumulation_steps=3,
                             max_staleness=4) == 2400
    # strictly on-policy still allows one step's worth
    assert initial_allowance(num_processes=2, token_budget=100,
                             gradient_accumulation_steps=3, max_staleness=0) == 600


def test_allowance_after_a_step_follows_what_the_step_consumed():
    assert allowance_after_step(consumed_tokens=350, max_staleness=2) == 700
    assert allowance_after_step(consumed_tokens=350, max_staleness=0) == 350
    assert allowance_after_step(consumed_tokens=0, max_staleness=2) == 2  # never 0: a group can always start


def test_on_policy_extension_is_one_row_per_process():
    assert on_policy_extension(token_budget=128, num_processes=1) == 128
    assert on_policy_extension(token_budget=128, num_processes=4) == 512


def test_a_sample_exactly_max_staleness_behind_is_still_trained():
    assert staleness(model_version=3, current_version=5) == 2
    assert not is_stale(3, 5, max_staleness=2)
    assert is_stale(3, 6, max_staleness=2)
    assert not is_stale(5, 5, max_staleness=0)
    assert is_stale(4, 5, max_staleness=0)


def test_may_start_group_never_deadlocks_on_a_group_larger_than_the_allowance():
    assert may_start_group(held_tokens=0, allowance=10, groups_finished=0, groups_in_flight=0)
    assert not may_start_group(held_tokens=0, allowance=10, groups_finished=0, groups_in_flight=1)
    assert may_start_group(held_tokens=0, allowance=1, groups_finished=3, groups_in_flight=0)
    assert may_start_group(held_tokens=9, allowance=10, groups_finished=3, groups_in_flight=2)
    assert not may_start_group(held_tokens=10, allowance=10, groups_finished=3, groups_in_flight=0)


# -- the rollout process's state machine ------------------------------------------------------------


def test_one_group_at_a_time_until_the_first_group_is_generated():
    admission = Admission(max_staleness=4)
    view = TrainerView(model_version=0, token_allowance=10_000, consumed_tokens=0)
    assert admission.blocker(8, view, CAP) is None
    admission.on_group_started(8)
    assert admission.blocker(8, view, CAP) == BLOCKED_FIRST_GROUP
    for _ in range(8):
        admission.on_rollout_finished()
    admission.on_generation_ended()
    admission.on_group_generated(8 * 50, 8)
    assert admission.tokens_per_rollout == 50
    assert admission.blocker(8, view, CAP) is None


def test_held_tokens_block_at_the_allowance_and_consuming_frees_them():
    admission = Admission(max_staleness=1)
    run_group(admission, num_rollouts=4, tokens_per_rollout=100, num_samples=4)  # 400 tokens queued
    view = TrainerView(model_version=0, token_allowance=400, consumed_tokens=0)
    assert admission.held_tokens(view) == 400
    assert admission.blocker(4, view, CAP) == IDLE_STALENESS
    consumed = TrainerView(model_version=0, token_allowance=400, consumed_tokens=400)
    assert admission.blocker(4, consumed, CAP) is None
    admission.on_group_started(4)  # in flight: counted at the running estimate
    assert admission.held_tokens(consumed) == 400
    assert admission.blocker(4, consumed, CAP) == IDLE_STALENESS


def test_the_concurrency_cap_counts_rollouts_but_never_blocks_an_empty_loop():
    admission = Admission(max_staleness=4)
    view = TrainerView(model_version=0, token_allowance=10_000, consumed_tokens=0)
    run_group(admission, num_rollouts=4, tokens_per_rollout=10, num_samples=4)
    assert admission.blocker(8, view, cap=4) is None  # nothing in flight: a group larger than the cap starts
    admission.on_group_started(8)
    assert admission.blocker(1, view, cap=8) == BLOCKED_CONCURRENCY
    admission.on_rollout_finished()
    assert admission.blocker(1, view, cap=8) is None


def test_a_version_whose_groups_are_all_dropped_does_not_wait_for_a_sync():
    admission = Admission(max_staleness=0)
    run_group(admission, num_rollouts=4, tokens_per_rollout=100, num_samples=4)
    consumed = TrainerView(model_version=0, token_allowance=400, consumed_tokens=400)
    assert admission.blocker(4, consumed, CAP) is None
    # the version's worth is started: 400 tokens at the estimate of 100 per rollout
    started = admission.on_group_started(4)
    assert started.tokens == 400
    for _ in range(4):
        admission.on_rollout_finished()
    admission.on_generation_ended()
    admission.on_group_generated(400, 4)
    assert admission.blocker(4, consumed, CAP) is not None  # being scored: its samples may still come
    assert admission.tokens_started_at_version == 400
    # scored: zero reward std, no sample reaches the trainer; the version gets its share back
    admission.on_group_scored(started, num_samples=0)
    admission.on_group_left_scoring(400)
    admission.on_group_closed()
    assert admission.tokens_started_at_version == 0
    assert admission.blocker(4, consumed, CAP) is None


def test_a_dropped_group_of_an_older_version_does_not_give_back_tokens_of_the_new_one():
    admission = Admission(max_staleness=0)
    view0 = TrainerView(model_version=0, token_allowance=400, consumed_tokens=0)
    run_group(admission, num_rollouts=4, tokens_per_rollout=100, num_samples=4)
    assert admission.blocker(4, view0, CAP) == IDLE_STALENESS
    view0 = TrainerView(model_version=0, token_allowance=800, consumed_tokens=400)
    assert admission.blocker(4, view0, CAP) is None
    old = admission.on_group_started(4)  # counted toward version 0
    assert admission.blocker(4, TrainerView(1, 800, 400), CAP) is None  # sees version 1: the counter restarts
    assert admission.tokens_started_at_version == 0
    new = admission.on_group_started(4)
    assert new.policy_version == 1
    admission.on_group_scored(old, num_samples=0)
    assert admission.tokens_started_at_version == new.tokens


def test_strictly_on_policy_with_gradient_accumulation_generates_one_step_per_version():
    """max_staleness=0, 4 micro-batches per step: a version's groups fill the whole step; the trainer
    extends the quota when it runs short before the sync; the next version starts a fresh quota."""
    budget, accumulation = 100, 4
    allowance = initial_allowance(num_processes=1, token_budget=budget,
                                  gradient_accumulation_steps=accumulation, max_staleness=0)
    admission = Admission(max_staleness=0)
    consumed = 0
    run_group(admission, num_rollouts=2, tokens_per_rollout=50, num_samples=2)  # the first group, 100 tokens
    consumed += 100
    view = TrainerView(0, allowance, consumed)
    starts = 0
    while admission.blocker(2, view, CAP) is None:
        run_group(admission, num_rollouts=2, tokens_per_rollout=50, num_samples=2)
        consumed += 100
        view = TrainerView(0, allowance, consumed)
        starts += 1
    assert starts == accumulation  # the step's 400 tokens, then the version waits
    assert admission.blocker(2, view, CAP) == IDLE_ON_POLICY
    # short of samples before the sync (groups dropped, say): the trainer extends the quota by a micro-batch
    allowance += on_policy_extension(budget, num_processes=1)
    view = TrainerView(0, allowance, consumed)
    assert admission.blocker(2, view, CAP) is None
    run_group(admission, num_rollouts=2, tokens_per_rollout=50, num_samples=2)
    consumed += 100
    assert admission.blocker(2, TrainerView(0, allowance, consumed), CAP) == IDLE_ON_POLICY
    # the optimizer step and the sync: a new allowance and version, a fresh quota
    allowance = allowance_after_step(consumed_tokens=accumulation * budget, max_staleness=0)
    assert admission.blocker(2, TrainerView(1, allowance, consumed), CAP) is None
    assert admission.tokens_started_at_version == 0


def test_several_processes_hold_a_step_of_every_process_rows():
    """Two processes train two rows per micro-batch: the allowance (and the held tokens it admits) is twice
    one process's, before the first step and after it."""
    one = initial_allowance(num_processes=1, token_budget=100, gradient_accumulation_steps=1, max_staleness=2)
    two = initial_allowance(num_processes=2, token_budget=100, gradient_accumulation_steps=1, max_staleness=2)
    assert two == 2 * one

    def groups_admitted(allowance: int) -> int:
        admission = Admission(max_staleness=2)
        count = 0
        view = TrainerView(0, allowance, 0)
        while admission.blocker(2, view, CAP) is None:
            run_group(admission, num_rollouts=2, tokens_per_rollout=50, num_samples=2)
            count += 1
        return count

    assert groups_admitted(two) == 2 * groups_admitted(one)
    # after a step, what both ranks consumed (200 each) sets the allowance, not rank 0's share
    assert allowance_after_step(consumed_tokens=2 * 200, max_staleness=2) == 800


@pytest.mark.parametrize("num_samples", [0, 3])
def test_a_group_always_closes_its_pending_tokens(num_samples):
    admission = Admission(max_staleness=4)
    run_group(admission, num_rollouts=3, tokens_per_rollout=10, num_samples=num_samples)
    assert admission.pending_tokens == 0
    assert admission.groups_open == 0 and admission.in_flight == 0 and admission.groups_generating == 0
    assert admission.produced_tokens == (30 if num_samples else 0)
