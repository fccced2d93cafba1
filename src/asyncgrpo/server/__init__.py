"""The embedded generation server (`asyncgrpo serve MODEL`): the subset of vLLM 0.33's HTTP protocol
that asyncgrpo uses, over a continuous-batching engine with a paged KV cache.

    serve.py              the `asyncgrpo serve` process: flags -> ServeConfig, load, build, listen, stop on a
                          signal; `ServerThread` runs the same server inside another process
    build.py              EngineConfig and `build_engine`: the one place that assembles the engine's parts
    app.py                the HTTP app: the route classes composed, error and auth middlewares
    routes/               the route classes, each given the collaborators it needs: models (health, version,
                          models, metrics), generate, completions, chat, text, control, weights, lease, lora,
                          profile; engine_requests (what the generation routes share), choices
    protocol.py           request validation (vLLM shapes)
    responses.py          response bodies, stream chunks and their log-probs (vLLM shapes)
    chat.py               chat requests: messages and tools -> the chat template's prompt; tool calls
                          parsed back
    text_output.py        a sequence's text as its tokens arrive: incremental detokenization, stop strings
    engine.py             engine thread: commands, pause modes, delivery to the event loop; each step
                          launched before the previous one is recorded (--async-scheduling)
    scheduler.py          admission, chunked prefill, prefix reuse, preemption; blocks behind the
                          window of a model windowed on every layer are released
    sequence.py           one generated continuation: its tokens (some still on the device), stop rules
    runner.py             one step -> one forward pass -> sampled tokens, queued for the host
    step_rows.py          a step's rows of the decode attention (decode tokens, short prompt chunks' tokens)
    step_output.py        a step's sampled tokens on their way to the host (one transfer) and into sequences
    host_copy.py          step inputs to the device through page-locked memory, without waiting for it
    kv_cache.py           paged K/V pools and the attention function registered with transformers, which
                          runs each segment of a step through its backend
    attention/            the attention backends, one file per segment kind (decode, shared-prefix decode,
                          fresh prompts, rows, continued chunks), and the execution plan that picks them
                          once at load (`attention/plan.py`)
    prefix_cache.py       block pool: reference counts, content-addressed full blocks, LRU eviction
    attention_math.py     masked attention with sliding windows and logit soft-capping; a model's variants
    recurrent_state.py    per-sequence state of a hybrid's Gated DeltaNet layers and their step forward
    decode_kernels.py     the Triton kernels of decode attention (per-sequence, shared-prefix, merge)
    step_graphs.py        fixed-shape steps replayed as CUDA graphs (keyed by the plan): decode rows, short
                          prompt chunks as rows, a hybrid's recurrent state slots, LoRA slots
    fused_layers.py / fused_norm.py  Llama-family attention/MLP blocks and RMSNorm as fused kernels,
                          each used only after a load-time accuracy check
    sampling.py           pure sampling math (min_p/top_k/top_p, processed log-probs, seeded race)
    weights.py            weight-transfer state machine and in-place loading by checkpoint name
    metrics.py            Prometheus series with vLLM's names
    loading.py            model (a vision-language checkpoint's text model), dtype, context length, EOS
                          ids, KV-cache size; refuses what it would serve wrongly
    self_check.py         load-time check: engine log-probs == the model's own forward, else the plan's
                          downgrade, else refused
    lease.py              the trainer lease: one trainer holds the server; pauses and half-done updates expire
    lora.py               LoRA adapters (--enable-lora): stacked slot weights, the batched delta, slot
                          ownership
    lora_files.py         reading and checking a PEFT adapter directory
"""
