"""AdmissionGate: the dispatcher's wait on the admission rule, and the RolloutIdle markers it sends."""

from __future__ import annotations

import asyncio
import queue

from asyncgrpo import metrics as M
from asyncgrpo.rollout.admission import Admission
from asyncgrpo.rollout.admission_gate import AdmissionGate
from asyncgrpo.rollout.channel import IDLE_OUT_OF_PROMPTS, IDLE_STALENESS, RolloutIdle, TrainerView


class FakeChannel:
    """The two things the gate uses: the trainer's view and the samples queue."""

    def __init__(self, view: TrainerView) -> None:
        self.view = view
        self.samples: queue.Queue = queue.Queue()

    def trainer_view(self) -> TrainerView:
        return self.view

    def sent(self) -> list:
        items = []
        while not self.samples.empty():
            items.append(self.samples.get_nowait())
        return items


def _one_group_queued(admission: Admission, num_tokens: int) -> None:
    """A group of two rollouts went all the way through: generated, scored, its samples queued."""
    admission.on_group_started(2)
    admission.on_rollout_finished()
    admission.on_rollout_finished()
    admission.on_generation_ended()
    admission.on_group_generated(num_tokens, 2)
    admission.on_samples_queued(num_tokens)
    admission.on_group_left_scoring(num_tokens)
    admission.on_group_closed()


def test_blocked_with_no_group_open_the_gate_says_so_once_per_view_and_times_the_wait():
    admission = Admission(max_staleness=1)
    _one_group_queued(admission, num_tokens=100)
    blocked_at = TrainerView(model_version=0, token_allowance=50, consumed_tokens=0)
    channel = FakeChannel(blocked_at)
    records: list[tuple[str, float]] = []
    gate = AdmissionGate(admission=admission, channel=channel, cap=lambda: 8,
                         record=lambda name, value: records.append((name, value)))

    async def run() -> None:
        admitted = asyncio.create_task(gate.admit(2))
        await asyncio.sleep(0.2)  # several polls against the same view
        assert not admitted.done()
        # the trainer took it all
        channel.view = TrainerView(model_version=0, token_allowance=50, consumed_tokens=100)
        gate.on_progress()
        await asyncio.wait_for(admitted, timeout=1.0)

    asyncio.run(run())
    assert channel.sent() == [RolloutIdle(IDLE_STALENESS, blocked_at)]
    ((name, waited_s),) = records
    assert name == M.ROLLOUT_BACKPRESSURE_S and waited_s > 0.1


def test_end_of_prompts_waits_for_every_open_group_then_sends_the_final_idle():
    admission = Admission(max_staleness=1)
    admission.on_group_started(2)
    channel = FakeChannel(TrainerView(model_version=0, token_allowance=50, consumed_tokens=0))
    gate = AdmissionGate(admission=admission, channel=channel, cap=lambda: 8, record=lambda name, value: None)

    async def run() -> None:
        ended = asyncio.create_task(gate.end_of_prompts())
        await asyncio.sleep(0.1)
        assert not ended.done() and channel.samples.empty()
        admission.on_group_closed()
        gate.on_progress()
        await asyncio.wait_for(ended, timeout=1.0)

    asyncio.run(run())
    (final,) = channel.sent()
    assert final == RolloutIdle(IDLE_OUT_OF_PROMPTS, None) and final.final
