"""Fault 4: a resumed run trains every prompt exactly once per epoch: rollout_state.json records the
prompts trained out of order above the resume position, and the resumed rollout skips them."""

from __future__ import annotations

import asyncio
import json

import pytest
from fault_helpers import MODEL, short_run_config, spread_reward
from transformers import TrainerCallback

from asyncgrpo import AsyncGRPOTrainer, AsyncRolloutLoop
from asyncgrpo.checkpoint import RolloutState, read_rollout_state, write_rollout_state
from asyncgrpo.data.prompts import iter_prompts
from asyncgrpo.tasks import arithmetic
from asyncgrpo.train.progress import TrainedPrompts


def test_prompts_done_out_of_order_are_recorded_and_read_back(tmp_path):
    progress = TrainedPrompts(10)
    for position in (10, 12, 13, 15):
        progress.on_group_finished(position, 1)
    for position in (12, 13, 15):
        progress.on_sample_consumed(position)
    assert progress.trained_position == 10 and progress.trained_above == (12, 13, 15)
    progress.on_sample_consumed(10)
    assert progress.trained_position == 11 and progress.trained_above == (12, 13, 15)

    write_rollout_state(tmp_path, RolloutState(progress.trained_position, 3, progress.trained_above))
    assert read_rollout_state(tmp_path) == RolloutState(11, 3, (12, 13, 15))
    (tmp_path / "rollout_state.json").write_text(json.dumps({"trained_position": 4, "model_version": 2}))
    assert read_rollout_state(tmp_path).trained_above == ()  # written by an older version
    with pytest.raises(ValueError, match="above trained_position=11"):
        RolloutState(11, 3, (5,))


def test_the_prompt_stream_skips_trained_positions_without_asking_filter_prompt():
    rows = [{"prompt": [{"role": "user", "content": str(i)}]} for i in range(6)]
    asked = []

    def filter_prompt(row_index, row, epoch):
        asked.append(row_index)
        return True

    stream = iter_prompts(rows, seed=0, start_position=4, filter_prompt=filter_prompt, skip_positions={5, 7})
    items = [next(stream) for _ in range(5)]
    assert [(i.position, i.accepted) for i in items] == [(4, True), (5, False),
                                                         (6, True), (7, False), (8, True)]
    assert len(asked) == 3


class StopAt(TrainerCallback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            control.should_training_stop = True


class OutOfOrderLoop(AsyncRolloutLoop):
    """Every fourth group generates 3 s late, so the groups dispatched after it finish (and are
    trained) before it: prompts are done out of order, above the resume position."""

    async def generate_one(self, prompt, tools, group_id=0):
        if group_id % 4 == 1:
            await asyncio.sleep(3.0)
        return await super().generate_one(prompt, tools, group_id)


class RecordingTrainer(AsyncGRPOTrainer):
    """Records the prompt position of every trained sample."""

    loop_cls = OutOfOrderLoop

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.trained.extend(inputs.positions)
        return super().training_step(model, inputs, num_items_in_batch)


def _trainer(out, url, callbacks=()):
    args = short_run_config(
        out, url, num_train_epochs=1, save_strategy="steps", save_steps=2, token_budget=160,
        max_staleness=100,  # nothing is dropped stale: every prompt must show up as trained
    )
    trainer = RecordingTrainer(
        model=MODEL, reward_funcs=spread_reward, train_dataset=arithmetic.make_dataset(20, seed=2), args=args,
        callbacks=list(callbacks),
    )
    trainer.trained = []
    return trainer


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_and_resume_trains_every_prompt_exactly_once(tmp_path, server):
    out = tmp_path / "out"
    first = _trainer(out, server.url, [StopAt(4)])
    first.train()
    assert first.state.global_step == 4
    state = read_rollout_state(out / "checkpoint-4")
    print(f"checkpoint-4: trained_position {state.trained_position}, trained_above {state.trained_above}")
    assert state.trained_above, "no prompt finished out of order: the test would not show a duplicate"

    second = _trainer(out, server.url)
    second.train(resume_from_checkpoint=True)
    before, after = set(first.trained), set(second.trained)
    assert not before & after, f"trained twice: {sorted(before & after)}"
    assert before | after == set(range(20)), f"never trained: {sorted(set(range(20)) - before - after)}"
