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
packing in `asyncgrpo.packing`.

Several processes (torchrun / accelerate launch): rank 0 owns the server link and the rollout process,
tells the other ranks the packing budget and serving dtype, and sends each rank one row per
micro-batch; the loss is normalised by the trained tokens of all rows. A DDP replica syncs from rank 0
alone; an FSDP2-sharded model is gathered bucket by bucket at each sync, every rank taking part
(`asyncgrpo.train.sharded_weights`).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import queue as queue_lib
import time
from collections.abc import Callable
from typing import Any

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase, Trainer, TrainerCallback

from asyncgrpo import metrics as M
from asyncgrpo.checkpoint import ROLLOUT_STATE_FILE, RolloutState, read_rollout_state, write_rollout_state
from asyncgrpo.config import AsyncGRPOConfig
from asyncgrpo.data.chat_templates import prepare_chat_template
from asyncgrpo.data.prompts import validate_prompt_dataset
from asyncgrpo.metrics import MetricsWindow
from asyncgrpo.packing.attention import TreeMask, enable_tree_attention, tree_attention_context
from asyncgrpo.packing.batcher import TokenBudgetBatcher
from asyncgrpo.packing.model_support import check_supported
from asyncgrpo.packing.tree import pack_row
from asyncgrpo.rollout.channel import ROLLOUT_PROCESS_NAME, RolloutChannel
from asyncgrpo.rollout.concurrency import initial_tokens_per_step, token_allowance
from asyncgrpo.rollout.loop import AsyncRolloutLoop
from asyncgrpo.rollout.worker import RolloutWorker, check_loop_inputs_picklable
from asyncgrpo.sync.packed import DEFAULT_BUFFER_SIZE_BYTES
from asyncgrpo.train.checkpoints import resolve_resume_checkpoint, staged_checkpoint
from asyncgrpo.train.distributed import broadcast_from_rank0, rank_and_world_size
from asyncgrpo.train.flops import FlopModel, peak_flops
from asyncgrpo.train.logprobs import token_logprobs
from asyncgrpo.train.lora_sync import AdapterSync, start_adapter_sync
from asyncgrpo.train.loss import LossStats, add_router_aux_loss, loss_metrics, merge_loss_stats, policy_loss
from asyncgrpo.train.model_setup import (
    eos_token_ids,
    hidden_states_and_head,
    is_sharded,
    load_policy,
    load_tokenizer,
    logit_processing,
    router_aux_loss_coef,
    server_weight_metas,
    train_text_model_only,
    weights_for_server,
)
from asyncgrpo.train.nonfinite import NonFiniteGuard, drop_gradients
from asyncgrpo.train.progress import TrainedPrompts
from asyncgrpo.train.rollout_batches import MicroBatchInput, RolloutBatches
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.sharded_weights import push_sharded_weights
from asyncgrpo.train.step_metrics import StepTotals
from asyncgrpo.train.waiting import notice_while_waiting

logger = logging.getLogger(__name__)

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class AsyncGRPOTrainer(Trainer):
    """Asynchronous GRPO: a rollout process streams scored samples while this trainer consumes them.

    Args:
        model: model id or path (bundled ids such as `asyncgrpo/tiny-chat` work offline), or a
            `PreTrainedModel` (its attention is switched to the tree-attention backend). A
            vision-language checkpoint is loaded whole and trains its text model only.
        reward_funcs: a reward function or a list of them (sync or `async def`, picklable).
        args: an `AsyncGRPOConfig`; default config when None.
        train_dataset: a conversational dataset with a `prompt` column; optional with a single
            `environment_factory` (then `max_steps` is required).
        processing_class: the tokenizer; loaded from the model when None.
        callbacks, optimizers: as in `transformers.Trainer`.
        peft_config: wrap the model with PEFT. Synced as an adapter when the server serves LoRA
            adapters at run time (`asyncgrpo.train.lora_sync`), merged otherwise.
        tools, environment_factory: agent training (see the rollout loop).

    Subclass and set `loop_cls` to an `AsyncRolloutLoop` subclass to customise generation,
    filtering or advantages.
    """

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

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
        environment_factory: Callable | dict[str, Callable] | None = None,
    ) -> None:
        if mp.current_process().name == ROLLOUT_PROCESS_NAME:
            raise RuntimeError(
                "AsyncGRPOTrainer was constructed inside the rollout process: the training script runs "
                "training when it is imported. The rollout process is spawned and imports the script to "
                "find the reward functions, tools or loop class defined there; put the training code "
                "under `if __name__ == \"__main__\":`"
            )
        if args is None:
            args = AsyncGRPOConfig(output_dir="asyncgrpo-output")
        if not isinstance(args, AsyncGRPOConfig):
            raise TypeError(f"`args` must be an AsyncGRPOConfig, got {type(args).__name__}")

        if isinstance(model, str):
            self.model_id = model
            model = load_policy(
                model, dtype=args.dtype, init_kwargs=args.model_init_kwargs, trust_remote_code=args.trust_remote_code
            )
        elif isinstance(model, PreTrainedModel):
            self.model_id = model.config._name_or_path
        else:
            raise TypeError(f"`model` must be a model id, a path or a PreTrainedModel, got {type(model).__name__}")
        check_supported(model.config)
        enable_tree_attention(model)
        train_text_model_only(model)  # a vision-language checkpoint trains its text model, on text-only prompts
        self._logit_processing = logit_processing(model.config)
        self._router_aux_loss_coef = router_aux_loss_coef(model.config, args.router_aux_loss_coef)
        self._flop_model = FlopModel.for_model(model)  # before PEFT: adapters are not the model's FLOPs

        if processing_class is None:
            revision = (args.model_init_kwargs or {}).get("revision")
            processing_class = load_tokenizer(self.model_id, trust_remote_code=args.trust_remote_code, revision=revision)

        # the tool loop renders the growing conversation each turn: its template must keep earlier
        # turns unchanged (known families are switched to a bundled training template)
        prepare_chat_template(
            processing_class,
            tools_enabled=bool(tools) or environment_factory is not None,
            chat_template_kwargs=args.chat_template_kwargs,
        )
        if peft_config is not None:
            model = _wrap_peft(model, peft_config)
        self._peft_config = peft_config  # LoRA hook: read at train() to choose the sync
        self._adapter_sync: AdapterSync | None = None  # LoRA hook: set for adapter-only sync

        if reward_funcs is None:
            reward_funcs = []
        self.reward_funcs = list(reward_funcs) if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        for i, fn in enumerate(self.reward_funcs):
            if not callable(fn):
                raise TypeError(
                    f"reward_funcs[{i}] is a {type(fn).__name__}, not a callable; reward models given as ids or "
                    "PreTrainedModels are not supported: wrap the model behind a picklable reward function"
                )
        self.tools = list(tools or [])
        self.environment_factory = environment_factory
        if not self.reward_funcs and environment_factory is None:
            raise ValueError("no reward source: pass `reward_funcs`, or an `environment_factory` whose class defines get_reward")
        if train_dataset is None:
            if environment_factory is None or isinstance(environment_factory, dict):
                raise ValueError(
                    "`train_dataset` is required unless a single `environment_factory` provides the prompts from reset()"
                )
            if args.max_steps <= 0:
                raise ValueError("without a `train_dataset`, set `max_steps` in AsyncGRPOConfig: there is no epoch to count")
        else:
            validate_prompt_dataset(
                train_dataset,
                environment=environment_factory is not None,
                environment_names=list(environment_factory) if isinstance(environment_factory, dict) else None,
            )
        self.prompt_dataset = train_dataset

        super().__init__(
            model=model,
            args=args,
            data_collator=_identity,
            train_dataset=None,
            processing_class=processing_class,
            callbacks=callbacks,
            optimizers=optimizers,
        )
        self.add_callback(_PipelineCallback(self))
        self._window = MetricsWindow()
        self._server: ServerLink | None = None
        self._worker: RolloutWorker | None = None
        self._channel: RolloutChannel | None = None
        self._batches: RolloutBatches | None = None
        self._progress: TrainedPrompts | None = None
        self.model_version = 0
        self.last_trained_position = 0
        self._step = StepTotals()
        self._completions_table: list[dict] = []
        self._loss_stats: LossStats | None = None
        self._num_tokens_forwarded = 0
        self._serving_dtype = torch.float32
        self._peak_flops: float | None = None
        self._nonfinite = NonFiniteGuard()
        self._step_skipped = False  # the current optimizer step had a non-finite loss or gradient
        self._checkpoint_staging = None  # set while a checkpoint is written (see _save_checkpoint)
        fsdp_plugin = getattr(self.accelerator.state, "fsdp_plugin", None)
        if fsdp_plugin is not None and getattr(fsdp_plugin, "fsdp_version", 1) != 2:
            raise ValueError(
                "FSDP version 1 is not supported: weight sync gathers FSDP2's DTensor parameters; set "
                "fsdp_config={'fsdp_version': 2} (or `accelerate launch --fsdp_version 2`)"
            )
        if args.fsdp and not self.is_fsdp_enabled:
            logger.warning(
                "fsdp=%r has no effect on %s: accelerate shards only on accelerators, so every process holds "
                "the whole model (data parallel)", args.fsdp, args.device,
            )

    # -- set-up and tear-down of the pipeline ------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, trial: Any = None, **kwargs: Any) -> Any:
        self._check_picklable()
        args = self.args
        if resume_from_checkpoint:  # never a half-written checkpoint (asyncgrpo.train.checkpoints)
            resume_from_checkpoint = resolve_resume_checkpoint(resume_from_checkpoint, args.output_dir)
        resumed = self._rollout_state(resume_from_checkpoint)
        start_position, self.model_version = resumed.trained_position, resumed.model_version
        user_max_steps = args.max_steps
        try:
            # rank 0 talks to the server; every rank needs the packing budget and the serving dtype
            info = broadcast_from_rank0(self._connect, "connecting to the inference server")
            self._token_budget = self._resolve_token_budget(info)
            self._serving_dtype = _DTYPE_NAMES.get(str(info.dtype).replace("torch.", ""), torch.float32)
            self._peak_flops = peak_flops(args.device, self._training_dtype())
            total_positions = self._total_positions(start_position)
            if self._server is not None and self._adapter_sync is None:  # LoRA hook: adapters need no transfer group
                self._server.init_weight_transfer(args.device)
            self._sync_weights(self.model_version)  # the server serves exactly the weights being trained
            if self._server is not None:
                self._start_rollout(info, resumed)  # the rollout process sees the user's max_steps
            if args.max_steps <= 0:
                if total_positions is None:
                    raise ValueError("a streaming train_dataset has no length to count epochs: set `max_steps`")
                # epochs stop the run; max_steps is only a safety cap the Trainer needs for a stream
                args.max_steps = max(1, total_positions * args.num_generations)
            self._batches = self._make_batches(total_positions, start_position)
            return super().train(resume_from_checkpoint=resume_from_checkpoint, trial=trial, **kwargs)
        finally:
            args.max_steps = user_max_steps
            self._shutdown()

    def _connect(self) -> Any:
        """Rank 0: open the server link, wait for the server and read what it serves."""
        url, timeout_s = self.args.vllm_server_base_url, self.args.vllm_server_timeout
        self._server = ServerLink(url, timeout_s=timeout_s, api_key=self.args.vllm_server_api_key)
        with notice_while_waiting(lambda waited: (
            f"waiting for the inference server at {url} ({waited:.0f} s so far; giving up after "
            f"vllm_server_timeout={timeout_s:g} s): start it (`asyncgrpo serve MODEL` or `vllm serve MODEL`) "
            "or fix vllm_server_base_url"
        )):
            info = self._server.connect()
        self._warn_dtype(info)
        # LoRA hook: adapter-only sync when the server serves LoRA adapters at run time (else None: merged)
        self._adapter_sync = start_adapter_sync(
            self._peft_config, info.lora, base_url=url, output_dir=self.args.output_dir,
            max_staleness=self.args.max_staleness, timeout_s=timeout_s, api_key=self.args.vllm_server_api_key,
            sharded=is_sharded(self.model),
        )
        return info

    def _check_picklable(self) -> None:
        """Before anything starts: everything the spawned rollout process receives must pickle."""
        check_loop_inputs_picklable(
            self.loop_cls,
            {"reward_funcs": self.reward_funcs, "tools": self.tools,
             "environment_factory": self.environment_factory, "config": self.args},
        )

    def _rollout_state(self, checkpoint: str | None) -> RolloutState:
        if not checkpoint:
            return RolloutState()
        state = read_rollout_state(checkpoint)
        assert state is not None, f"{checkpoint} was checked complete, yet has no {ROLLOUT_STATE_FILE}"
        return state

    def _training_dtype(self) -> torch.dtype:
        """The precision of the training matmuls: the mixed-precision dtype, else the weights'."""
        if self.args.bf16:
            return torch.bfloat16
        if self.args.fp16:
            return torch.float16
        return next(self.model.parameters()).dtype

    def _resolve_token_budget(self, info: Any) -> int:
        if self.args.token_budget is not None:
            return int(self.args.token_budget)
        if info.max_model_len is None:
            raise ValueError("token_budget is None and the server did not report max_model_len: set `token_budget`")
        return int(info.max_model_len)

    def _warn_dtype(self, info: Any) -> None:
        if not getattr(info, "dtype", None):
            return
        trainer_dtype = str(next(self.model.parameters()).dtype).replace("torch.", "")
        server_dtype = str(info.dtype).replace("torch.", "")
        if server_dtype != trainer_dtype:
            logger.warning(
                "the server runs in %s and the trainer in %s: importance ratios will carry that mismatch "
                "(watch sampling/sampling_logp_difference); start the server with --dtype %s to close it",
                server_dtype, trainer_dtype, trainer_dtype,
            )

    def _total_positions(self, start_position: int) -> int | None:
        if self.args.max_steps > 0 or self.prompt_dataset is None:
            return None  # max_steps stops the run; the rollout cycles through epochs
        try:
            n = len(self.prompt_dataset)
        except TypeError:
            return None  # a stream: it ends when the rollout process runs out of prompts
        return math.ceil(self.args.num_train_epochs * n)

    def _start_rollout(self, info: Any, resumed: RolloutState) -> None:
        args = self.args
        ctx = mp.get_context("spawn")
        initial = token_allowance(
            args.max_staleness,
            initial_tokens_per_step(args.world_size, self._token_budget, args.gradient_accumulation_steps),
        )
        self._channel = RolloutChannel.create(ctx, initial_allowance=initial)
        if args.log_completions:
            self._channel.extra["completions"] = ctx.Queue()
        self._channel.model_version.value = self.model_version
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
            "dataset_skip_positions": resumed.trained_above,
            # LoRA hook: rollouts ask for the adapter version they started under
            "lora_name": self._adapter_sync.name_template if self._adapter_sync is not None else None,
        }
        self._worker = RolloutWorker(self.loop_cls, loop_kwargs, self._channel)
        self._worker.start()

    def _make_batches(self, total_positions: int | None, start_position: int) -> RolloutBatches:
        self._progress = TrainedPrompts(start_position)
        batcher = TokenBudgetBatcher(token_budget=self._token_budget, num_processes=self.args.world_size)
        return RolloutBatches(
            channel=self._channel,
            batcher=batcher,
            progress=self._progress,
            check_health=self._check_worker_health,
            current_version=lambda: self.model_version,
            record=self._window.record,
            max_staleness=self.args.max_staleness,
            token_budget=self._token_budget,
            total_positions=total_positions,
        )

    def _check_worker_health(self) -> None:
        if self._worker is not None:
            self._worker.check_health()

    def _shutdown(self) -> None:
        if self._progress is not None:
            self.last_trained_position = self._progress.trained_position
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self._channel is not None:
            self._channel.close()
        if self._adapter_sync is not None:  # LoRA hook: unload the adapter versions, remove their folders
            self._adapter_sync.close()
            self._adapter_sync = None
        if self._server is not None:
            self._server.close()
            self._server = None

    # -- the Trainer hooks ---------------------------------------------------------------------

    def get_train_dataloader(self) -> RolloutBatches:
        assert self._batches is not None, "train() builds the rollout pipeline before the Trainer asks for data"
        return self._batches

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, None]:
        batch: list[MicroBatchInput] = []
        for _ in range(num_batches):
            try:
                batch.append(next(epoch_iterator))
            except StopIteration:
                break
        self._step.wait_s += self._batches.pop_wait_s()
        if not batch:
            self.control.should_training_stop = True
        return batch, None

    def floating_point_ops(self, inputs: Any) -> int:
        return 0  # MFU is reported as perf/*_mfu from the packed rows (asyncgrpo.train.flops), not Trainer's flos

    def training_step(self, model: torch.nn.Module, inputs: MicroBatchInput, num_items_in_batch: Any = None) -> torch.Tensor:
        args = self.args
        model.train()
        device = args.device
        t0 = time.perf_counter()
        row = pack_row(inputs.samples).to(device, non_blocking=True)
        with self.compute_loss_context_manager(), tree_attention_context(TreeMask.from_row(row, device)):
            hidden, head, aux_loss = hidden_states_and_head(
                model, row.input_ids, row.position_ids, router_aux_loss=self._router_aux_loss_coef > 0
            )
            logps = token_logprobs(
                hidden,
                head.weight,
                row.pred_index,
                row.target_ids,
                temperature=args.temperature,
                lm_head_bias=getattr(head, "bias", None),
                **self._logit_processing,
                topk_ids=row.topk_ids if args.score_centering else None,
                candidate_ids=row.candidate_ids,
                candidate_offsets=row.candidate_offsets,
            )
            result = policy_loss(
                logps.target_logprobs,
                row.sampler_logprobs,
                row.advantages,
                row.completion_index,
                num_trained_tokens_global=inputs.num_trained_tokens_global,
                gradient_accumulation_steps=args.gradient_accumulation_steps,
                score_centering=args.score_centering,
                topk_logprobs=logps.topk_logprobs,
                sampler_topk_logprobs=row.topk_logprobs if args.score_centering else None,
                entropy=logps.entropy,
                epsilon=args.epsilon,
                epsilon_high=args.epsilon_high,
                is_clip_min=args.vllm_importance_sampling_clip_min,
                is_clip_max=args.vllm_importance_sampling_clip_max,
            )
            if aux_loss is not None:
                result = add_router_aux_loss(
                    result, aux_loss, coef=self._router_aux_loss_coef,
                    gradient_accumulation_steps=args.gradient_accumulation_steps,
                    num_processes=self.accelerator.num_processes,
                )
            loss = result.loss
        t_fwd = time.perf_counter()
        # The loss is already normalised by the trained tokens of all processes; data-parallel
        # gradient averaging divides by the world size once more, which this undoes.
        self.accelerator.backward(loss * self.accelerator.num_processes)
        t_bwd = time.perf_counter()
        self._step.add_micro_batch(row, inputs.samples, inputs.stats, fwd_s=t_fwd - t0, fwd_bwd_s=t_bwd - t0)
        self._loss_stats = result.stats if self._loss_stats is None else merge_loss_stats(self._loss_stats, result.stats)
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
        self._drain_worker_metrics()
        self._print_completions()
        logs = {**logs, **self._window.reduce(), M.NUM_TOKENS: self._num_tokens_forwarded}
        if self._loss_stats is not None:
            logs.update(loss_metrics(_all_reduce_stats(self._loss_stats)))
            self._loss_stats = None
        super().log(logs, start_time) if start_time is not None else super().log(logs)

    def _print_completions(self) -> None:
        """`log_completions`: a table of the latest sampled completions (one per group), rank 0 only."""
        q = self._channel.extra.get("completions") if self._channel is not None else None
        if q is None:
            return
        entries = []
        while True:
            try:
                entries.append(q.get_nowait())
            except (queue_lib.Empty, EOFError, OSError):
                break
        limit = self.args.num_completions_to_print
        entries = entries[-limit:] if limit else entries
        if not entries or not self.is_world_process_zero():
            return
        from rich.console import Console
        from rich.table import Table

        table = Table(title=f"completions at step {self.state.global_step}", show_lines=True)
        for column in ("prompt", "completion", "reward", "advantage", "version"):
            table.add_column(column)
        for e in entries:
            prompt = (e["prompt"] or [{}])[-1].get("content", "")
            completion = "\n".join(str(m.get("content") or m.get("tool_calls") or "") for m in e["completion"])
            table.add_row(prompt, completion, f"{e['reward']:.3f}", f"{e['advantage']:+.3f}", str(e["model_version"]))
        Console().print(table)

    def _drain_worker_metrics(self) -> None:
        if self._channel is None:
            return
        while True:
            try:
                record = self._channel.metrics.get_nowait()
            except queue_lib.Empty:
                return
            except (EOFError, OSError):
                return
            self._window.add(record)

    def _get_output_dir(self, trial: Any) -> str:
        if self._checkpoint_staging is not None:  # the Trainer writes the checkpoint there
            return str(self._checkpoint_staging)
        return super()._get_output_dir(trial=trial)

    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """The Trainer's checkpoint plus rollout_state.json, written to a staging folder and renamed
        into place when complete (a full disk: `CheckpointDiskFullError` naming the path)."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

        run_dir = self._get_output_dir(trial=trial)
        folder = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        main = self.is_world_process_zero()
        with staged_checkpoint(run_dir, folder, is_main=main, barrier=self.accelerator.wait_for_everyone) as staging:
            self._checkpoint_staging = staging
            try:
                super()._save_checkpoint(model, trial)
            finally:
                self._checkpoint_staging = None
            if main and self._progress is not None:
                progress = self._progress
                state = RolloutState(progress.trained_position, self.model_version, progress.trained_above)
                write_rollout_state(staging / folder, state)
        if self.args.should_save:  # the Trainer rotated the staging folder; the real one is here
            rotate_checkpoints(
                output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True,
            )

    # -- what happens after each optimizer step ---------------------------------------------------

    def _after_optimizer_step(self) -> None:
        args = self.args
        step_totals, self._step = self._step.across_processes(), StepTotals()
        if self._channel is not None:  # what the whole step consumed, every process's rows
            self._channel.token_allowance.value = token_allowance(args.max_staleness, max(step_totals.raw_tokens, 1))
        sync_s: dict[str, float] = {}
        self._window.record(M.OPTIMIZER_NONFINITE_STEP_COUNT, int(self._step_skipped))
        if self.state.global_step % args.weight_sync_steps == 0 and not self._step_skipped:
            sync_s = self._sync_weights(self.model_version + 1)
            self.model_version += 1
            if self._channel is not None:
                self._channel.model_version.value = self.model_version
        step_totals.record_into(
            self._window, sync_s, flop_model=self._flop_model, peak_flops=self._peak_flops,
            num_processes=args.world_size,
        )
        self._window.end_step()
        self._num_tokens_forwarded += step_totals.forwarded_tokens

    def _sync_weights(self, model_version: int) -> dict[str, float]:
        """Push the weights that become `model_version` (published to the rollout process after this)."""
        if self._adapter_sync is not None:  # LoRA hook: adapter-only sync (asyncgrpo.train.lora_sync)
            return self._adapter_sync.push(self.model, version=model_version, dtype=self._serving_dtype)
        version, dtype = f"step-{self.state.global_step}", self._serving_dtype
        if is_sharded(self.model):  # FSDP2: every rank gathers, rank 0 sends
            return push_sharded_weights(
                self.model, dtype, link=self._server, version=version, bucket_bytes=DEFAULT_BUFFER_SIZE_BYTES
            )
        if self._server is None:
            return {}  # a replica (DDP): rank 0 holds the same weights and sends them alone
        tensors = weights_for_server(self.model, dtype)
        try:
            return self._server.sync_weights(
                lambda: tensors, version=version, metas=server_weight_metas(self.model, dtype)
            )
        finally:
            tensors.close()  # after a failed push: runs its end (PEFT adapters are unmerged)


class _PipelineCallback(TrainerCallback):
    """Runs the trainer's after-step work at the Trainer's `on_step_end`."""

    def __init__(self, trainer: AsyncGRPOTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._step.optimizer_started = time.perf_counter()

    def on_optimizer_step(self, args, state, control, **kwargs):
        self.trainer._step.optimizer_s = time.perf_counter() - self.trainer._step.optimizer_started

    def on_step_end(self, args, state, control, **kwargs):
        self.trainer._after_optimizer_step()


def _all_reduce_stats(stats: LossStats) -> LossStats:
    """Loss statistics summed (and min/max-ed) over all processes."""
    import torch.distributed as dist

    if rank_and_world_size()[1] == 1:
        return stats
    for values, op in ((stats.sums, dist.ReduceOp.SUM), (stats.mins, dist.ReduceOp.MIN), (stats.maxs, dist.ReduceOp.MAX)):
        for value in values.values():
            dist.all_reduce(value, op=op)
    return stats


def _identity(features: Any) -> Any:
    return features


def _wrap_peft(model: PreTrainedModel, peft_config: Any) -> Any:
    from peft import get_peft_model

    targets = getattr(peft_config, "target_modules", None) or []
    if isinstance(targets, str):
        targets = [targets]
    if "lm_head" in targets or "lm_head" in (getattr(peft_config, "modules_to_save", None) or []):
        raise ValueError("PEFT adapters on lm_head are not supported: remove lm_head from target_modules/modules_to_save")
    return get_peft_model(model, peft_config)
