"""`AsyncGRPOTrainer`: a `transformers.Trainer` whose batches come from a live rollout process.

    train()
      |- check picklability, connect to the server, resolve token_budget, initial weight push
      |- spawn the rollout process (AsyncRolloutLoop) ------------------------------+
      |- Trainer's loop:                                                            | samples
      |     get_batch_samples -> RolloutBatches (queue -> stale drop -> batcher) <--+
      |     training_step: pack row -> tree-attention forward -> log-probs -> loss -> backward
      |     optimizer step -> on_step_end: token allowance, weight sync, version++
      '- stop the rollout process (always), close the server link

What waits on what: a step waits only when the queue is empty (`perf/rollout_wait_s`); the rollout
process waits only when it is `max_staleness` steps ahead (`rollout/backpressure_s`). Every wait
has a timeout and checks the other side's health, so a failure surfaces as an error, never a hang.
This module wires; the math lives in `asyncgrpo.train.logprobs` and `asyncgrpo.train.loss`, the
packing in `asyncgrpo.packing`, the model's preparation in `asyncgrpo.train.startup`, the logged
metrics in `asyncgrpo.train.step_metrics`.

Several inference servers (a list in `vllm_server_base_url`): rank 0 holds one link per server
(`ServerLinks`); each sync pauses them all, pushes to each and resumes them
(`train/weights/every_server.py`); the rollout process sends each group to one of them.

Several processes (torchrun / accelerate launch): rank 0 owns the server links and the rollout process,
tells the other ranks the packing budget and serving dtype, and sends each rank one row per
micro-batch; the loss is normalised by the trained tokens of all rows. A DDP replica syncs from rank 0
alone; an FSDP2-sharded model is gathered bucket by bucket at each sync, every rank taking part
(`asyncgrpo.train.weights`: one transport, `self.weights`, whatever moves the weights).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

from asyncgrpo import metrics as M
from asyncgrpo.capture_gate import device_work
from asyncgrpo.checkpoint import ROLLOUT_STATE_FILE, RolloutState, read_rollout_pending, read_rollout_state
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.config_rules import server_urls
from asyncgrpo.data.prompts import end_position
from asyncgrpo.packing.attention import TreeMask, tree_attention_context
from asyncgrpo.packing.batcher import TokenBudgetBatcher
from asyncgrpo.packing.tree import pack_row
from asyncgrpo.rollout.admission import allowance_after_step, initial_allowance
from asyncgrpo.rollout.generate import EnvironmentFactory
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.rewards import callable_name
from asyncgrpo.rollout.spawn_inputs import check_spawn_inputs
from asyncgrpo.train.checkpoints import StagedCheckpoints, resolve_resume_checkpoint
from asyncgrpo.train.completions_table import print_completions
from asyncgrpo.train.distributed import broadcast_from_rank0, timed_barrier
from asyncgrpo.train.flops import peak_flops
from asyncgrpo.train.inputs import (
    check_args,
    check_not_in_rollout_process,
    check_prompt_source,
    reward_func_list,
)
from asyncgrpo.train.model_setup import eos_token_ids
from asyncgrpo.train.nonfinite import NonFiniteGuard, drop_gradients
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.train.rollout_batches import MicroBatchInput, RolloutBatches
from asyncgrpo.train.rollout_process import RolloutProcess
from asyncgrpo.train.row_loss import LossSettings, row_loss
from asyncgrpo.train.server_link import ServerLinks
from asyncgrpo.train.serving import token_budget, training_dtype, warn_server_mismatches
from asyncgrpo.train.sigterm import sigterm_stops_training
from asyncgrpo.train.startup import fit_accelerator, prepare_policy_and_tokenizer
from asyncgrpo.train.step_metrics import TrainerMetrics
from asyncgrpo.train.weights import WeightSettings, WeightTransport
from asyncgrpo.train.weights.choose import make_transports
from asyncgrpo.types import WeightVersion


class AsyncGRPOTrainer(StagedCheckpoints, Trainer):
    """Asynchronous GRPO: a rollout process streams scored samples while this trainer consumes them.

    Args:
        model: model id or path (bundled ids such as `asyncgrpo/tiny-chat` work offline; a `.gguf`
            file is converted once into a float32 model folder in the cache, `asyncgrpo.modeling.gguf`),
            or a `PreTrainedModel` (its attention is switched to the tree-attention backend). A
            vision-language checkpoint is loaded whole and trains its text model only.
        reward_funcs: a reward function or a list of them (sync or `async def`, picklable).
        args: an `AsyncGRPOConfig`; default config when None.
        train_dataset: a conversational dataset with a `prompt` column; optional with a single
            `environment_factory` (then `max_steps` is required).
        processing_class: the tokenizer; loaded from the model when None.
        callbacks, optimizers: as in `transformers.Trainer`.
        peft_config: wrap the model with PEFT. Synced as an adapter when the server serves LoRA
            adapters at run time (`asyncgrpo.train.weights.adapters`), merged otherwise.
        tools, environment_factory: agent training (see the rollout loop).

    Subclass and set `loop_cls` to an `AsyncRolloutLoop` subclass to customise generation,
    filtering or advantages.
    """

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    runs_harness = False  # HarnessAsyncGRPOTrainer: its harness/* counts join the logged count metrics

    def __init__(
        self,
        model: str | PreTrainedModel,
        reward_funcs: Callable | list[Callable] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: PreTrainedTokenizerBase | None = None,
        callbacks: list[TrainerCallback] | None = None,
        optimizers: tuple = (None, None),
        peft_config: Any = None,
        tools: list[Callable] | None = None,
        environment_factory: EnvironmentFactory | dict[str, EnvironmentFactory] | None = None,
    ) -> None:
        check_not_in_rollout_process()
        args = check_args(args)
        policy = prepare_policy_and_tokenizer(
            model, args, processing_class=processing_class, peft_config=peft_config,
            tools_enabled=bool(tools) or environment_factory is not None, fsdp=bool(args.fsdp),
        )
        self.model_id = policy.model_id
        self.fast_paths = policy.fast_paths  # compiled layers, the tree attention's kernels
        self._peft_config = peft_config  # read at train() to choose the sync (adapter only or merged)

        self.reward_funcs = reward_func_list(reward_funcs)
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        check_prompt_source(self.reward_funcs, train_dataset, environment_factory, args.max_steps,
                            rollout_reward=self.loop_cls.provides_rollout_reward)
        self.prompt_dataset = train_dataset

        super().__init__(
            model=policy.model,
            args=args,
            data_collator=_identity,
            train_dataset=None,
            processing_class=policy.tokenizer,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.add_callback(_PipelineCallback(self))
        fit_accelerator(self.accelerator, args, is_fsdp_enabled=self.is_fsdp_enabled)
        self._metrics = TrainerMetrics(policy.flop_model)
        self._servers: ServerLinks | None = None  # rank 0's, one link per server
        self.weights: WeightTransport | None = None  # set by train(): how the weights reach the server
        self._rollout: RolloutProcess | None = None  # rank 0's, set by train()
        self._batches: RolloutBatches | None = None
        self._progress: TrainedPrompts | None = None
        self.model_version = WeightVersion(0)
        self.last_trained_position = 0
        self._nonfinite = NonFiniteGuard()
        self._step_skipped = False  # the current optimizer step had a non-finite loss or gradient
        self._loss_settings = LossSettings.from_config(
            args, logit_processing=policy.logit_processing, router_aux_loss_coef=policy.router_aux_loss_coef,
            num_processes=self.accelerator.num_processes, fused_logprob_head=policy.fast_paths.compiled,
        )

    # -- set-up and tear-down of the pipeline ------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        with sigterm_stops_training():  # clean-up below runs on SIGTERM too (a scheduler's preemption)
            return self._train(
                resume_from_checkpoint, trial, ignore_keys_for_eval=ignore_keys_for_eval, **kwargs
            )

    def _train(self, resume_from_checkpoint: str | bool | None, trial: Any, **kwargs: Any) -> Any:
        self._check_picklable()
        args = self.args
        resumed, resumed_samples = RolloutState(), []
        if resume_from_checkpoint:  # never a half-written checkpoint (asyncgrpo.train.checkpoints)
            resume_from_checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
            resumed = read_rollout_state(resume_from_checkpoint)
            assert resumed is not None, (
                f"{resume_from_checkpoint} was checked complete, yet has no {ROLLOUT_STATE_FILE}"
            )
            # the untrained samples of prompts partly trained at the checkpoint: trained, not generated again
            resumed_samples = read_rollout_pending(resume_from_checkpoint)
        start_position, self.model_version = resumed.trained_position, WeightVersion(resumed.model_version)
        self._metrics.num_tokens_forwarded = resumed.num_tokens  # num_tokens goes on counting
        user_max_steps = args.max_steps
        try:
            matmul_dtype = training_dtype(
                bf16=args.bf16, fp16=args.fp16, weights_dtype=next(self.model.parameters()).dtype
            )
            # rank 0 talks to the servers; every rank needs the packing budget and the serving dtype
            infos = broadcast_from_rank0(
                lambda: self._connect(matmul_dtype), "connecting to the inference server"
            )
            info = infos[0]  # the servers serve one model with one max_model_len (ServerLinks.connect)
            if self._servers is None:  # another rank: rank 0 sends; it joins a sharded model's gathers
                self.weights = make_transports(None, infos, self.model, WeightSettings.from_config(args))
            self._token_budget = token_budget(args.token_budget, info)
            self._metrics.window.declare_counts(M.count_metrics(  # logged as 0 in windows without events
                tool_names=[callable_name(t) for t in self.tools],
                has_tools=bool(self.tools) or self.environment_factory is not None,
                server_has_metrics=any(i.has_metrics for i in infos),
                has_harness=self.runs_harness,
            ))
            self._metrics.peak_flops = peak_flops(args.device, matmul_dtype)
            total_positions = end_position(args.max_steps, args.num_train_epochs, self.prompt_dataset)
            # every server serves exactly the weights being trained
            self.weights.push(self.model, self.model_version)
            if self._servers is not None:  # the rollout process sees the user's max_steps
                self._start_rollout(info, resumed, skip={it.position for it in resumed_samples})
            if args.max_steps <= 0:
                if total_positions is None:
                    raise ValueError(
                        "a streaming train_dataset has no length to count epochs: set `max_steps`"
                    )
                # epochs stop the run; max_steps is only a safety cap the Trainer needs for a stream
                args.max_steps = max(1, total_positions * args.num_generations)
            self._batches = self._make_batches(total_positions, start_position, resumed_samples)
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            args.max_steps = user_max_steps
            self._shutdown()

    def _connect(self, matmul_dtype: torch.dtype) -> list:
        """Rank 0: open a link to every server, wait for each, read what it serves, set up the weight
        transport (adapter-only when the server serves LoRA adapters at run time, else the full weights;
        one per server). Returns the servers' descriptions, in order."""
        args = self.args
        self._servers = ServerLinks.open(server_urls(args.vllm_server_base_url),
                                         timeout_s=args.vllm_server_timeout,
                                         api_key=args.vllm_server_api_key, keep_kv=args.keep_kv_across_syncs,
                                         restart_timeout_s=args.vllm_server_restart_timeout)
        infos = self._servers.connect()
        for info in {info.dtype: info for info in infos}.values():  # said once per serving dtype
            warn_server_mismatches(matmul_dtype, args.max_completion_length, info)
        self.weights = make_transports(self._servers, infos, self.model, WeightSettings.from_config(args),
                                       peft_config=self._peft_config)
        self.weights.init()
        return infos

    def _check_picklable(self) -> None:
        """Before anything starts: everything the spawned rollout process receives pickles and can be
        imported."""
        check_spawn_inputs(
            self.loop_cls,
            {"reward_funcs": self.reward_funcs, "tools": self.tools,
             "environment_factory": self.environment_factory, "config": self.args,
             **self._extra_loop_kwargs()},
        )

    def _extra_loop_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of a subclass's `loop_cls` beyond `AsyncRolloutLoop`'s (checked and pickled with
        them)."""
        return {}

    def _start_rollout(self, info: Any, resumed: RolloutState, skip: set[int]) -> None:
        """`skip`: positions whose remaining samples the checkpoint kept (not generated again)."""
        args = self.args
        loop_kwargs = {
            "config": args,
            "model_name": info.model_name,
            "dataset": self.prompt_dataset,
            "reward_funcs": self.reward_funcs,
            "processing_class": self.processing_class,
            "eos_token_ids": eos_token_ids(self.model, self.processing_class),
            "tools": self.tools,
            "environment_factory": self.environment_factory,
            "dataset_start_index": resumed.trained_position,
            "dataset_skip_positions": sorted(set(resumed.trained_above) | skip),
            # adapter-only LoRA: rollouts ask for the adapter version they started under
            "lora_name": self.weights.lora_name,
            # (train() pushed them): tokens of a restarted server's own are asked again
            "expects_pushed_weights": True,
            **self._extra_loop_kwargs(),
        }
        initial = initial_allowance(
            num_processes=args.world_size, token_budget=self._token_budget,
            gradient_accumulation_steps=args.gradient_accumulation_steps, max_staleness=args.max_staleness,
        )
        self._rollout = RolloutProcess(self.loop_cls, loop_kwargs, initial_allowance=initial,
                                       model_version=self.model_version, log_completions=args.log_completions)

    def _make_batches(self, total_positions: int | None, start_position: int,
                      resumed_samples: list) -> RolloutBatches:
        self._progress = TrainedPrompts(start_position)
        batcher = TokenBudgetBatcher(token_budget=self._token_budget, num_processes=self.args.world_size)
        return RolloutBatches(
            channel=self._rollout.channel if self._rollout is not None else None,
            batcher=batcher,
            progress=self._progress,
            check_health=self._check_pipeline if self._rollout is not None else lambda: None,
            current_version=lambda: self.model_version,
            record=self._metrics.window.record,
            add_record=self._metrics.window.add,
            max_staleness=self.args.max_staleness,
            token_budget=self._token_budget,
            total_positions=total_positions,
            # a run whose every group or sample is dropped stops instead of waiting forever
            no_sample_timeout_s=float(self.args.rollout_worker_timeout),
            resumed_samples=resumed_samples if self._rollout is not None else [],
        )

    def _shutdown(self) -> None:
        if self._progress is not None:
            self.last_trained_position = self._progress.trained_position
        if self._rollout is not None:
            self._rollout.stop()
            self._rollout = None
        if self.weights is not None:  # leaves the transfer group; LoRA: unloads the adapter versions
            self.weights.close()  # (closed, it stays readable: ServerRestarts.recoveries)
        if self._servers is not None:
            self._servers.close()
            self._servers = None

    # -- the Trainer hooks ---------------------------------------------------------------------

    def get_train_dataloader(self) -> RolloutBatches:
        assert self._batches is not None, (
            "train() builds the rollout pipeline before the Trainer asks for data"
        )
        return self._batches

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, None]:
        batch: list[MicroBatchInput] = []
        for _ in range(num_batches):
            try:
                batch.append(next(epoch_iterator))
            except StopIteration:
                break
        self._metrics.step.wait_s += self._batches.pop_wait_s()
        if not batch:
            self.control.should_training_stop = True
        return batch, None

    def floating_point_ops(self, inputs: Any) -> int:
        # MFU is reported as perf/*_mfu from the packed rows (asyncgrpo.train.flops), not Trainer's flos
        return 0

    def training_step(
        self, model: torch.nn.Module, inputs: MicroBatchInput, num_items_in_batch: Any = None
    ) -> torch.Tensor:
        model.train()
        device = self.args.device
        t0 = time.perf_counter()
        row = pack_row(inputs.samples).to(device, non_blocking=True)
        # FlashAttention-4 takes masks of one static size: the row's tensors padded to the token budget
        mask = TreeMask.from_row(
            row,
            device,
            mask_capacity=self._token_budget if self.fast_paths.flex_options else None,
            kernel_options=self.fast_paths.flex_options,
        )
        # device_work: no graph capture of a server in this process meanwhile (compilation may sync the
        # device)
        with device_work():
            with self.compute_loss_context_manager(), tree_attention_context(mask):
                result = row_loss(
                    model,
                    row,
                    num_trained_tokens_global=inputs.num_trained_tokens_global,
                    settings=self._loss_settings,
                )
                loss = result.loss
            # the timers measure finished GPU work, not its launch (perf/*_s, perf/*_mfu)
            _wait_for_device(device)
            t_fwd = time.perf_counter()
            # The loss is already normalised by the trained tokens of all processes; data-parallel
            # gradient averaging divides by the world size once more, which this undoes.
            self.accelerator.backward(loss * self.accelerator.num_processes)
            # costs nothing: add_micro_batch's torch.unique waits for the device anyway
            _wait_for_device(device)
        t_bwd = time.perf_counter()
        self._metrics.add_micro_batch(row, inputs, result.stats, fwd_s=t_fwd - t0, fwd_bwd_s=t_bwd - t0)
        self._nonfinite.add_loss(loss)
        return loss.detach()

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        # the Trainer calls this between clipping and optimizer.step(): the last point to keep an
        # inf/NaN loss or gradient out of the weights (and so out of the server)
        self._step_skipped = not self._nonfinite.step_is_finite(grad_norm, step=self.state.global_step + 1)
        if self._step_skipped:
            drop_gradients(model)
        return grad_norm

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self._rollout is not None:  # rank 0: what the rollout process reported since the last log
            for record in self._rollout.metrics():
                self._metrics.window.add(record)
            entries = self._rollout.completions()
            if entries:  # `log_completions`: the latest sampled completions, as a table
                print_completions(
                    entries, step=self.state.global_step, limit=self.args.num_completions_to_print
                )
        logs = self._metrics.logs(logs)
        super().log(logs, start_time) if start_time is not None else super().log(logs)

    def _rollout_pending(self) -> list:
        if self._batches is None or self._rollout is None:  # rank 0 owns the queue
            return []
        return self._batches.pending_samples()

    def _rollout_state(self) -> RolloutState | None:
        """What `StagedCheckpoints` writes beside the Trainer's checkpoint (rank 0, once training started)."""
        progress = self._progress
        if progress is None:
            return None
        return RolloutState(progress.trained_position, int(self.model_version), progress.trained_above,
                            num_tokens=self._metrics.num_tokens_forwarded)

    # -- what happens after each optimizer step ---------------------------------------------------

    def _after_optimizer_step(self) -> None:
        args = self.args
        syncs = self.state.global_step % args.weight_sync_steps == 0 and not self._step_skipped
        # the processes line up before a sync (rank 0 pauses the server only once all are there): the wait
        # is perf/weight_sync_barrier_s
        barrier_s = timed_barrier() if syncs else 0.0
        step_totals = self._metrics.end_step(skipped=self._step_skipped, sync_barrier_s=barrier_s)
        if self._rollout is not None:  # what the whole step consumed, every process's rows
            self._rollout.publish(
                token_allowance=allowance_after_step(step_totals.raw_tokens, args.max_staleness)
            )
        sync_s: dict[str, float] = {}
        if syncs:
            # every rank; the server serves the next version before the rollout process hears of it
            version = self.model_version.next()
            sync_s = self.weights.push(self.model, version)
            self.model_version = version
            if self._rollout is not None:
                self._rollout.publish(model_version=self.model_version)
        self._metrics.record_step(step_totals, sync_s, num_processes=args.world_size)

    def _check_pipeline(self) -> None:
        """While the trainer waits for samples: the rollout process lives, and the weight transport may act
        (a server that restarted gets the trained weights back: its rollouts wait for them)."""
        self._rollout.check_health()
        self.weights.idle(self.model, self.model_version)


class _PipelineCallback(TrainerCallback):
    """Runs the trainer's after-step work at the Trainer's `on_step_end`."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._metrics.step.optimizer_started = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        step = self.trainer._metrics.step
        step.optimizer_s = time.perf_counter() - step.optimizer_started

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_optimizer_step()


def _identity(features: Any) -> Any:
    return features


def _wait_for_device(device: torch.device) -> None:
    """The training stream's work done (not the whole device's: a server inside this process runs beside
    it)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
