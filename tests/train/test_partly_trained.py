"""Prompts partly trained at a checkpoint (a group straddling two optimizer steps): their untrained samples
are kept and trained first after a resume, and the rollout process's empty marker for them is ignored."""

from __future__ import annotations

import multiprocessing as mp
import time

from asyncgrpo.checkpoint import read_rollout_pending, write_rollout_pending
from asyncgrpo.packing import Sample, TokenBudgetBatcher
from asyncgrpo.rollout.channel import GroupFinished, QueuedSample, RolloutChannel
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.train.rollout_batches import RolloutBatches


def _item(position, i, length=8):
    tokens = [position + 1] + [100 + 10 * position + i] * (length - 1)
    return QueuedSample(
        Sample(tokens, [j > 0 for j in range(length)], [0.0] * length, 1.0, position),
        position,
        position,
        time.time(),
    )


def test_partly_trained_positions_until_done():
    progress = TrainedPrompts(0)
    progress.on_sample_consumed(3)
    assert progress.partly_trained == {3} and progress.awaiting_marker == {3}
    progress.on_group_finished(3, 2)
    assert progress.partly_trained == {3} and progress.awaiting_marker == frozenset()
    progress.on_sample_consumed(3)
    assert progress.partly_trained == frozenset()


def test_pending_samples_round_trip_through_the_checkpoint(tmp_path):
    items = [_item(2, 0), _item(2, 1)]
    write_rollout_pending(tmp_path, items)
    assert [(it.position, it.sample.token_ids.tolist()) for it in read_rollout_pending(tmp_path)] == [
        (it.position, it.sample.token_ids.tolist()) for it in items
    ]
    assert read_rollout_pending(tmp_path / "nowhere") == []


def test_resumed_samples_are_trained_first_and_the_skipped_prompts_marker_is_ignored():
    channel = RolloutChannel.create(mp.get_context("spawn"), initial_allowance=1_000)
    progress = TrainedPrompts(2)
    batches = RolloutBatches(
        channel=channel,
        batcher=TokenBudgetBatcher(token_budget=16, num_processes=1),
        progress=progress,
        check_health=lambda: None,
        current_version=lambda: 0,
        record=lambda name, value: None,
        add_record=lambda record: None,
        max_staleness=1,
        token_budget=16,
        total_positions=4,
        poll_s=0.05,
        resumed_samples=[_item(2, 0), _item(2, 1)],
    )
    channel.samples.put(GroupFinished(2, 2, 0))  # the rollout process skipped prompt 2
    channel.samples.put(_item(3, 0))
    channel.samples.put(GroupFinished(3, 3, 1))
    got = [mb.positions for mb in batches]
    assert sorted(p for positions in got for p in positions) == [2, 2, 3]
    assert progress.trained_position == 4  # prompt 2 counted once, with its two kept samples
