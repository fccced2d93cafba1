"""`HarnessAsyncGRPOTrainer`: asynchronous GRPO for an agent that lives in its own program.

    trainer (this module: AsyncGRPOTrainer with a harness) --spawns--> rollout process
        HarnessRolloutLoop: per rollout, harness(HarnessRun(base_url, api_key, prompt, row))
            --OpenAI API--> RecordingProxy --> inference server; every call's token ids and log-probs kept
        recorded turns --reconcile (extend or fork)--> TrainingSequences --> the same samples, staleness,
        weight sync and metrics as AsyncGRPOTrainer

The agent is written against the OpenAI API (the `openai` SDK, LangChain, a CLI agent): it only needs a
base URL and an API key, and it returns a reward, or leaves scoring to `reward_funcs` over the recorded
conversation. What it runs between model calls (tools, sandboxes) is its own business; only the
model's tokens are trained. See docs/harness.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel, PreTrainedTokenizerBase, TrainerCallback

from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.rollout.harness import HarnessCommand, HarnessRun, as_harness
from asyncgrpo.rollout.harness_loop import HarnessRolloutLoop
from asyncgrpo.train.trainer import AsyncGRPOTrainer

logger = logging.getLogger(__name__)

__all__ = ["HarnessAsyncGRPOTrainer", "HarnessCommand", "HarnessRun"]


class HarnessAsyncGRPOTrainer(AsyncGRPOTrainer):
    """Asynchronous GRPO where each rollout is one run of `harness`, an agent speaking the OpenAI API.

    Args:
        model: As `AsyncGRPOTrainer`'s.
        harness: The agent, run once per rollout with a base URL and an API key of its own (a recording
            proxy in front of the inference server): a callable `harness(run: HarnessRun) -> float | None`
            (sync or `async def`, picklable: defined at module level), or a command run as a subprocess
            (a string, a list of strings or a `HarnessCommand`) that finds its endpoint in
            `OPENAI_BASE_URL` / `OPENAI_API_KEY` and writes its reward to `$ASYNCGRPO_REWARD_FILE`.
            Returning None leaves the rollout to `reward_funcs`.
        reward_funcs: Optional reward functions, called over the recorded conversation (`completions`:
            the last call's messages after the task, then the model's reply); added to the harness's reward.
        args, train_dataset, processing_class, callbacks, optimizers, peft_config: As `AsyncGRPOTrainer`'s.
            The dataset's `prompt` is the task each harness run gets (`HarnessRun.prompt`), with its row.

    Sampling is the config's (`temperature`; a harness's own sampling fields are replaced, with a
    warning): the loss assumes the distribution the tokens were drawn from. Truncated sampling (`top_k`,
    `top_p`, `min_p`) is refused: the chat route returns no candidate sets to renormalise over. A harness
    that raises, runs past `harness_timeout` or makes no model call is counted (`harness/failed_count`,
    `harness/timeout_count`, `harness/no_call_count`), warned about with its cause and left out of its
    group; the run goes on. At most `max_concurrent_harnesses` run at once.
    """

    loop_cls = HarnessRolloutLoop
    runs_harness = True  # the harness/* counts are logged in every window, 0 without events

    def __init__(
        self,
        model: str | PreTrainedModel,
        harness: Callable[[HarnessRun], Any] | HarnessCommand | str | list[str],
        reward_funcs: Callable | list[Callable] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
    ) -> None:
        self.harness = as_harness(harness)
        if args is not None and isinstance(args, AsyncGRPOConfig) and args.sampling_is_truncated:
            raise ValueError(
                f"HarnessAsyncGRPOTrainer samples through the OpenAI routes, which return no candidate sets "
                f"to renormalise over: top_k={args.top_k}, top_p={args.top_p}, min_p={args.min_p} would bias "
                "every importance ratio; leave top_k=0, top_p=1.0 and min_p=None"
            )
        if train_dataset is None:
            raise ValueError("HarnessAsyncGRPOTrainer needs a `train_dataset`: its `prompt` column is each "
                             "harness run's task")
        super().__init__(
            model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
            processing_class=processing_class, callbacks=callbacks, optimizers=optimizers,
            peft_config=peft_config,
        )

    def _extra_loop_kwargs(self) -> dict[str, Any]:
        return {"harness": self.harness}
