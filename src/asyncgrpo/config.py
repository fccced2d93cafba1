"""`AsyncGRPOConfig`: every knob of asynchronous GRPO training and its default.

One dataclass over `transformers.TrainingArguments`; a field is documented in the class docstring and
in its `metadata["help"]` (shown by `HfArgumentParser`). `__post_init__` applies the rules of
`asyncgrpo.config_rules`: it parses JSON-string dicts, resolves the defaults that differ from
`TrainingArguments` and raises `ValueError` naming the field, its value and what to set instead.
Components receive the values they use, not this object.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments
from transformers.trainer_utils import SchedulerType

from asyncgrpo.config_rules import (
    DTYPES,
    FLEX_BACKENDS,
    parse_dict,
    reject_unsupported,
    resolve_defaults,
    validate,
)

API_KEY_ENV = "VLLM_API_KEY"  # vLLM's own variable for its --api-key
_MASKED_KEY = "<VLLM_SERVER_API_KEY>"


@dataclass
class AsyncGRPOConfig(TrainingArguments):
    r"""Configuration of `AsyncGRPOTrainer`.

    Only the parameters specific to asynchronous GRPO are listed here; see `transformers.TrainingArguments`
    for the rest. These `TrainingArguments` defaults differ:

    - `logging_steps`: 1 instead of 500.
    - `gradient_checkpointing`: True instead of False.
    - `bf16`: True unless `fp16` is set, instead of False. Transformers refuses bf16 without a
      bf16-capable accelerator unless `use_cpu=True`; in that case the default falls back to False
      with a warning (CPU training with bf16 autocast: set `use_cpu=True`).
    - `learning_rate`: 1e-6 instead of 5e-5.
    - `lr_scheduler_type`: "constant" instead of "linear": the number of optimizer steps per epoch is
      not known in advance when multi-turn rollouts fork into several samples. For a decaying rate,
      set a schedule together with an explicit `max_steps`.
    - `ignore_data_skip`: always True (a False value is overridden with a warning): the base Trainer's
      skip-and-replay resume does not apply to a live rollout queue; `rollout_state.json` is used.
    - `report_to`: "none".
    - `torch_compile`: None ("where it runs", below) instead of False.

    `torch_compile` compiles each decoder layer in place, for any row length, and the elementwise work
    of the log-prob head, instead of the whole model (`asyncgrpo.train.compiled_layers`). Its default
    differs too: None instead of False, meaning "where it runs": on a CUDA process without FSDP the
    trainer compiles the layers and checks them against the eager ones on one packed row before
    training (`asyncgrpo.train.fast_paths`; the probe's time, compile included, is logged and is the
    run's one-time compile cost), and trains on the eager layers with a warning saying why when the
    check fails; on CPU the layers stay eager. True compiles without the check, False never does
    (`torch_compile_backend` or `torch_compile_mode` set means True). With compiled layers,
    `activation_memory_budget` replaces whole-layer gradient checkpointing by selective recomputation
    (see the field).

    Training length: `num_train_epochs` counts passes over the prompt dataset (distinct prompts
    trained, however many samples their rollouts fork into); an explicit `max_steps > 0` becomes the
    stop condition instead.

    Parameters that control the model:
        model_init_kwargs (`dict[str, Any]` or `str`, optional): Keyword arguments for
            `from_pretrained` when the model is given as a path or id (a JSON string is parsed). Its
            `revision` is also used to load the processing class.
        dtype (`str`, defaults to "float32"): dtype the weights are loaded in: "auto", "bfloat16",
            "float16" or "float32". float32 by default because the training-inference mismatch is
            sensitive to the trainer's own precision. A `dtype` in `model_init_kwargs` wins.
        trust_remote_code (`bool`, defaults to False): Allow models and tokenizers with custom code.
        activation_memory_budget (`float`, optional): With `torch_compile=True`, recompute selectively
            instead of whole layers: the compiled layers keep at most this fraction (in (0, 1]) of the
            activation memory that keeping every activation would take and recompute the cheapest
            operations for the rest (torch's `activation_memory_budget`, set for the process).
            Whole-layer `gradient_checkpointing` is then off. 0.5 measured 9-16 % more tokens/s than
            whole-layer checkpointing at about 3x its activation memory (docs/performance.md,
            "Training speed").
            None (default): `gradient_checkpointing` as set.
        flex_attention_backend (`str`, defaults to "auto"): The kernels of the tree attention on CUDA
            (FlexAttention): "triton", its own Triton kernels; "flash", its FlashAttention-4 backend (the
            `flash-attn-4` package, optional; a Hopper or Blackwell GPU; compiled layers, so not with
            `torch_compile=False`); "auto", "flash" where the layers are compiled and it can run (the
            start-up check tries it first), "triton" otherwise. "flash" measured 10-19 % more tokens/s
            (docs/performance.md, "Training speed").
        router_aux_loss_coef (`float`, optional): Weight of a Mixture-of-Experts model's load-balancing
            loss added to the training loss (logged before scaling as `aux_loss`). None: the model
            config's value; 0.0 disables it; a positive value on a model without a router is an error.

    Parameters that control generation:
        num_generations (`int`, defaults to 8): Rollouts sampled per prompt (the group size, >= 2).
        max_completion_length (`int`, defaults to 2048): Maximum tokens generated per sampling request,
            i.e. per turn of a multi-turn rollout.
        temperature (`float`, defaults to 1.0): Sampling temperature (> 0).
        top_p (`float`, defaults to 1.0): Nucleus sampling mass, in (0, 1]. Below 1.0, `top_k` must be
            set too and the server must return candidate sets: the trainer renormalizes its
            log-probabilities over the set each token was sampled from.
        top_k (`int`, defaults to 0): Keep only the k most likely tokens; 0 disables top-k.
        min_p (`float`, optional): Minimum token probability relative to the most likely token, in
            [0, 1]. Above 0.0, `top_k` must be set too.
        repetition_penalty (`float`, defaults to 1.0): Sampler repetition penalty. Only 1.0 (none) is
            accepted: the trainer's log-probs do not include a penalty, so any other value would bias
            the importance ratios.
        chat_template_kwargs (`dict[str, Any]` or `str`, optional): Extra keyword arguments for
            `apply_chat_template` when rendering prompts (a JSON string is parsed), e.g.
            `{"enable_thinking": false}`.
        max_tool_calling_iterations (`int`, optional): Maximum tool-calling turns of a rollout. None:
            no limit, a rollout ends with the first assistant turn that calls no tool.
        tool_call_timeout (`float`, defaults to 300.0): Seconds one tool call (a `tools` function or an
            environment method) may run; a call that takes longer is reported to the model as a tool
            error and counted as a failed call (`tools/failure_frequency`). A sync tool's thread cannot
            be stopped: it keeps one of the `max_concurrent_rollouts` tool threads until it returns.

    Parameters that control the inference server:
        vllm_server_base_url (`str` or `list[str]`, defaults to "http://localhost:8000"): Base URL of the
            vLLM (or embedded) server used for generation: one http(s) URL, or a list of several servers
            of the same model (on the command line, space-separated after the flag). With several, each
            group of rollouts goes to the server with the most free capacity (its concurrency cap minus
            its rollouts in flight) and stays there, turns and tools included; every weight sync pauses
            all of them, pushes the weights to each and resumes them; one that stops answering is left
            out until it answers again (docs/serving.md, "Several servers"). A malformed URL, an empty
            list, a server listed twice or a comma-joined string is refused at construction.
        vllm_server_timeout (`float`, defaults to 1800.0): Seconds for server calls: waiting for the
            server at start-up, each generation request and each weight-sync call. Waiting and
            weight-sync calls raise on timeout; a timed-out generation request is retried.
        vllm_server_restart_timeout (`float`, defaults to 0.0): Seconds to wait for a server that stops
            answering during training to come back on the same address (restarted by a supervisor);
            then the trainer pushes its weights into it and training goes on. 0: a server that does
            not answer within the requests' retries (about 20 s) stops the run.
        vllm_server_api_key (`str`, optional): The server's API key (`vllm serve --api-key` or
            `asyncgrpo serve --api-key`), sent as `Authorization: Bearer <key>` by every request of the
            trainer and the rollout process. None: the `VLLM_API_KEY` environment variable, if set. The
            key is masked when the config is printed or saved.

    Parameters that control the loss:
        epsilon (`float`, defaults to 0.2): Lower clipping bound: the trust region is
            [1 - epsilon, 1 + epsilon_high]; in (0, 1).
        epsilon_high (`float`, optional): Upper clipping bound; None uses `epsilon` (DAPO suggests 0.28).
        score_centering (`bool`, defaults to True): Train with score centering (the importance-weighted
            score of each sampled token minus its expectation under the sampler, over the sampler's
            top `num_sampler_logprobs` tokens) instead of the clipped surrogate objective.
        vllm_importance_sampling_clip_min (`float`, defaults to 0.5): Lower bound C_min of the
            policy/sampler importance ratio; tokens outside [C_min, C_max] are masked from the loss.
        vllm_importance_sampling_clip_max (`float`, defaults to 5.0): Upper bound C_max of that ratio.
        num_sampler_logprobs (`int`, defaults to 8): Top log-probabilities requested from the sampler
            per generated token, used by score centering (the server's `--max-logprobs` caps it).
        token_budget (`int`, optional): Maximum unique tokens forwarded in one packed row (one forward
            of one process); it also bounds the row's loss terms. None: the server's `max_model_len`.
            A sample longer than this is dropped with a warning.

    Parameters that control the asynchronous rollout pipeline:
        max_concurrent_rollouts (`int`, defaults to 512): Upper bound of rollouts running at once (each
            holds an environment, may run sync tools in a thread pool of this size and keeps a server
            connection). Below it, the server's KV-cache usage and `max_staleness` decide.
        max_staleness (`int`, defaults to 4): Weight updates a sample may lag behind the current model
            version before it is dropped. Generation is held to it: a new group starts only while the
            queued and in-flight tokens fit in what the trainer consumes in max(max_staleness, 1) steps.
        weight_sync_steps (`int`, defaults to 1): Optimizer steps between weight syncs to the server.
        keep_kv_across_syncs (`bool`, defaults to False): A weight sync pauses the server; by default it
            also drops the KV cache of the rollouts in flight (`clear_cache=true`), which then prefill
            their whole prompt and output again under the new weights. True keeps it: their next tokens
            attend over keys and values the older weights computed (the loss corrects for it through
            the sampler's own log-probs), and no rollout is computed twice (a recomputation that grows
            with the rollouts' length). The embedded server still drops its prefix cache at every push;
            vLLM keeps a stale one until its blocks are freed.
        weight_push (`str`, defaults to `"full"`): What a weight sync sends. `"full"`: every served weight.
            `"delta"`: after a first full push, only the elements that changed since the last push
            (compared bitwise in the serving dtype; their new values, and their flat indices or a
            bitmask, whichever is smaller), with a sketch of every resulting tensor that the server
            checks, so that it ends with exactly the trainer's weights. At RL learning rates that is a
            few percent of the bytes (1.6-8.2% for SmolLM2-135M at lr 1e-6 to 1e-5). The trainer keeps
            a copy of the last push in the serving dtype on its device (the GPU it sends from, or host
            memory): one more copy of the served weights (2 bytes a parameter in bf16). A push sends the
            full weights when a delta would not be smaller, after a server restart and when the server
            refuses the delta (it holds another weight version). Only the embedded server takes deltas,
            over gloo or NCCL: with vLLM, CUDA IPC, adapter-only LoRA sync or a sharded (FSDP2) model
            every push is full, and a warning says why.
        rollout_worker_timeout (`float`, defaults to 300.0): Seconds since the rollout process's last
            heartbeat after which the trainer considers it hung and fails. Also the longest the trainer
            waits while every group or sample that arrives is dropped (e.g. a reward that is NaN for every
            completion): then it fails with the drop counts and their causes instead of waiting forever.

    Parameters that control harness training (`HarnessAsyncGRPOTrainer`):
        harness_timeout (`float`, defaults to 600.0): Seconds one harness run (one rollout) may take; a
            harness still running then is stopped (a command is killed, an async harness cancelled; a
            sync harness's thread cannot be stopped and keeps running unrecorded), counted in
            `harness/timeout_count` and left out of its group's advantages.
        max_concurrent_harnesses (`int`, optional): Upper bound of harness runs at once (each command
            is a process of its own). None: `max_concurrent_rollouts`.

    Parameters that control logging:
        log_completions (`bool`, defaults to False): Log a sample of (prompt, completion) pairs every
            `logging_steps` steps.
        num_completions_to_print (`int`, optional): How many completions `log_completions` prints;
            None prints all of the logged sample.
    """

    # -- TrainingArguments fields with different defaults ------------------------------------------
    learning_rate: float = field(default=1e-6, metadata={"help": "The initial learning rate (1e-6)."})
    lr_scheduler_type: SchedulerType | str = field(
        default="constant",
        metadata={
            "help": "Learning-rate schedule ('constant' by default: steps per epoch are unknown in advance; "
            "use a decaying schedule only with an explicit max_steps)."
        },
    )
    logging_steps: float = field(
        default=1,
        metadata={"help": "Log every X optimizer steps (an integer, or a ratio of total steps if < 1)."},
    )
    gradient_checkpointing: bool | None = field(
        default=None,
        metadata={"help": "Trade compute for memory. None (the default) means True.", "nargs": "?",
                  "const": True},
    )
    bf16: bool | None = field(
        default=None,
        metadata={
            "help": "Mixed precision in bf16. None (the default) means True unless fp16 is set; False with a "
            "warning when no bf16-capable accelerator is found and use_cpu is False."
        },
    )
    ignore_data_skip: bool = field(
        default=True,
        metadata={"help": "Always True: resuming uses rollout_state.json, not the Trainer's "
                  "skip-and-replay."},
    )
    report_to: None | str | list[str] = field(
        default="none",
        metadata={"help": "Integrations to report logs to ('none' by default, 'all' for every installed "
                  "one)."},
    )

    # -- model -------------------------------------------------------------------------------------
    model_init_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Keyword arguments for from_pretrained when the model is a path or id "
                  "(JSON string ok)."},
    )
    dtype: str = field(
        default="float32",
        metadata={
            "help": "dtype the weights are loaded in: 'auto', 'bfloat16', 'float16' or 'float32' (default, "
            "the training-inference mismatch is sensitive to the trainer's precision).",
            "choices": list(DTYPES),
        },
    )
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Allow models and tokenizers with custom code."}
    )
    activation_memory_budget: float | None = field(
        default=None,
        metadata={
            "help": "With torch_compile: recompute selectively instead of whole layers, keeping at "
            "most this fraction (0, 1] of the activation memory (e.g. 0.5); whole-layer "
            "gradient_checkpointing is then off."
        },
    )
    torch_compile: bool | None = field(
        default=None,
        metadata={
            "help": "Compile each decoder layer and the log-prob head. None (the default): on a CUDA process "
            "without FSDP, checked against the eager layers at start (eager, with a warning, if the check "
            "fails); off on CPU.",
            "nargs": "?",
            "const": True,
        },
    )
    flex_attention_backend: str = field(
        default="auto",
        metadata={
            "help": "Tree attention kernels on CUDA: 'triton' (FlexAttention's own), 'flash' (its "
            "FlashAttention-4 backend: the flash-attn-4 package, a Hopper or Blackwell GPU, compiled layers) "
            "or 'auto' ('flash' where it runs, else 'triton').",
            "choices": list(FLEX_BACKENDS),
        },
    )
    router_aux_loss_coef: float | None = field(
        default=None,
        metadata={
            "help": "Weight of an MoE model's load-balancing loss (logged as aux_loss); None uses the model "
            "config's value, 0.0 disables it."
        },
    )

    # -- generation --------------------------------------------------------------------------------
    num_generations: int = field(
        default=8, metadata={"help": "Rollouts sampled per prompt (group size, >= 2)."}
    )
    max_completion_length: int = field(
        default=2048, metadata={"help": "Maximum tokens generated per sampling request (per turn)."}
    )
    temperature: float = field(default=1.0, metadata={"help": "Sampling temperature (> 0)."})
    top_p: float = field(
        default=1.0,
        metadata={"help": "Nucleus sampling mass in (0, 1]; below 1.0 top_k must be set too."},
    )
    top_k: int = field(default=0, metadata={"help": "Keep the k most likely tokens; 0 disables top-k."})
    min_p: float | None = field(
        default=None,
        metadata={"help": "Minimum probability relative to the most likely token, in [0, 1]; needs "
                  "top_k > 0."},
    )
    repetition_penalty: float = field(
        default=1.0, metadata={"help": "Sampler repetition penalty; only 1.0 (none): the trainer's log-probs "
                               "do not include a penalty, any other value would bias the importance ratios."}
    )
    chat_template_kwargs: dict[str, Any] | str | None = field(
        default=None,
        metadata={"help": "Extra keyword arguments for apply_chat_template (JSON string ok)."},
    )
    max_tool_calling_iterations: int | None = field(
        default=None,
        metadata={"help": "Maximum tool-calling turns of a rollout; None means no limit."},
    )
    tool_call_timeout: float = field(
        default=300.0,
        metadata={"help": "Seconds one tool call may run before it is reported to the model as a tool "
                  "error."},
    )

    # -- inference server --------------------------------------------------------------------------
    vllm_server_base_url: str | list[str] = field(
        default="http://localhost:8000",
        metadata={
            "help": "Base URL of the vLLM (or embedded) server used for generation: one http(s) URL, or "
            "several (space-separated) to spread the rollout groups over them; each weight sync reaches all.",
            # HfArgumentParser takes a list field's default only from here (it reads default_factory alone)
            "default": "http://localhost:8000",
        },
    )
    vllm_server_timeout: float = field(
        default=1800.0,
        metadata={
            "help": "Seconds for server calls: start-up wait, each generation request (retried on timeout) "
            "and each weight-sync call."
        },
    )

    vllm_server_restart_timeout: float = field(
        default=0.0,
        metadata={"help": "Seconds to wait for a server that stops answering during training to come back "
                  "(restarted by a supervisor); 0: the run stops after the requests' retries (about 20 s)."},
    )
    vllm_server_api_key: str | None = field(
        default=None,
        metadata={"help": "The server's API key, sent as a bearer token by the trainer and the rollout "
                  "process; None reads the VLLM_API_KEY environment variable."},
    )

    # -- loss --------------------------------------------------------------------------------------
    epsilon: float = field(default=0.2, metadata={"help": "Lower clipping bound (trust region 1 - epsilon)."})
    epsilon_high: float | None = field(
        default=None, metadata={"help": "Upper clipping bound; None uses epsilon (DAPO suggests 0.28)."}
    )
    score_centering: bool = field(
        default=True,
        metadata={
            "help": "Train with score centering (importance-weighted score minus its expectation under the "
            "sampler's top tokens) instead of the clipped surrogate."
        },
    )
    vllm_importance_sampling_clip_min: float = field(
        default=0.5,
        metadata={"help": "Lower bound of the policy/sampler importance ratio; tokens outside are masked."},
    )
    vllm_importance_sampling_clip_max: float = field(
        default=5.0, metadata={"help": "Upper bound of the policy/sampler importance ratio."}
    )
    num_sampler_logprobs: int = field(
        default=8,
        metadata={"help": "Top log-probabilities requested from the sampler per token (score centering)."},
    )
    token_budget: int | None = field(
        default=None,
        metadata={"help": "Maximum unique tokens per packed row; None uses the server's max_model_len."},
    )

    # -- asynchronous rollout pipeline -------------------------------------------------------------
    max_concurrent_rollouts: int = field(
        default=512, metadata={"help": "Upper bound of rollouts running at once."}
    )
    max_staleness: int = field(
        default=4,
        metadata={
            "help": "Weight updates a sample may lag behind before it is dropped; generation is held to "
            "max(max_staleness, 1) steps' worth of tokens ahead of training."
        },
    )
    weight_sync_steps: int = field(default=1, metadata={"help": "Optimizer steps between weight syncs."})
    keep_kv_across_syncs: bool = field(
        default=False,
        metadata={
            "help": "Keep the KV cache of rollouts in flight when a weight sync pauses the server (no "
            "re-prefill; their next tokens attend over older weights' keys). False drops it, as "
            "clear_cache=true."
        },
    )
    weight_push: str = field(
        default="full",
        metadata={
            "help": "What a weight sync sends: 'full' (every weight) or 'delta' (after a first full push, "
            "the elements changed since the last push, checked by the server against a sketch of the "
            "trainer's weights; the embedded server only, over gloo or NCCL; the trainer keeps one more "
            "copy of the served weights)."
        },
    )
    rollout_worker_timeout: float = field(
        default=300.0,
        metadata={
            "help": "Seconds without a rollout-process heartbeat before the trainer fails; also the longest "
            "wait while everything that arrives is dropped (then it fails naming the drops and their causes)."
        },
    )

    # -- harness training --------------------------------------------------------------------------
    harness_timeout: float = field(
        default=600.0,
        metadata={"help": "Seconds one harness run may take before it is stopped and counted "
                  "(harness/timeout_count)."},
    )
    max_concurrent_harnesses: int | None = field(
        default=None,
        metadata={"help": "Upper bound of harness runs at once; None uses max_concurrent_rollouts."},
    )

    # -- logging -----------------------------------------------------------------------------------
    log_completions: bool = field(
        default=False, metadata={"help": "Log a sample of (prompt, completion) pairs every logging_steps."}
    )
    num_completions_to_print: int | None = field(
        default=None, metadata={"help": "How many completions log_completions prints; None prints all."}
    )

    def __post_init__(self) -> None:
        reject_unsupported(self)
        resolve_defaults(self)
        if self.vllm_server_api_key is None:  # the one place the environment is read
            self.vllm_server_api_key = os.environ.get(API_KEY_ENV) or None
        self.model_init_kwargs = parse_dict("model_init_kwargs", self.model_init_kwargs)
        self.chat_template_kwargs = parse_dict("chat_template_kwargs", self.chat_template_kwargs)
        if isinstance(self.vllm_server_base_url, tuple):  # a list, as JSON and the command line give it
            self.vllm_server_base_url = list(self.vllm_server_base_url)
        super().__post_init__()
        validate(self)

    @property
    def sampling_is_truncated(self) -> bool:
        """Whether top_k / top_p / min_p restrict what the sampler draws from (candidate sets matter)."""
        return self.top_k > 0 or self.top_p < 1 or bool(self.min_p)

    # the key must not reach logs, `training_args.bin`'s printed form or report_to integrations
    def to_dict(self) -> dict[str, Any]:
        d = super().to_dict()
        if d.get("vllm_server_api_key"):
            d["vllm_server_api_key"] = _MASKED_KEY
        return d

    def __str__(self) -> str:
        text = super().__str__()
        key = self.vllm_server_api_key
        return (text.replace(f"vllm_server_api_key={key},", f"vllm_server_api_key={_MASKED_KEY},")
                if key else text)

    __repr__ = __str__
