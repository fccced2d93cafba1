"""The reference's module path for the rollout records and loop:
`from asyncgrpo.async_rollout_worker import TurnRecord, RolloutGroup, TrainingSequence`.

They are defined in `asyncgrpo.types` and `asyncgrpo.rollout.loop`; this module only names them
where a user of the reference looks for them."""

from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.types import Rollout, RolloutGroup, TrainingSequence, TurnRecord

__all__ = ["AsyncRolloutLoop", "Rollout", "RolloutGroup", "TrainingSequence", "TurnRecord"]
