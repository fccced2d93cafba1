"""Adapter-only LoRA sync as a weight transport: each push writes the adapter and the server loads it.

Chosen once at start for a PEFT run (`choose_lora_sync`, which `choose.make_transport` asks):

    adapter-only   the server runs with LoRA enabled (vLLM: --enable-lora and
                   VLLM_ALLOW_RUNTIME_LORA_UPDATING=1; the embedded server: --enable-lora) and the adapter
                   is one it can serve: `AdapterSync` below
    merged         otherwise: the adapter is merged and the full weights are pushed (`gather.py`)

The choice is made when the server is already running, so a server whose LoRA limits are too small for
the run is an error naming the flags to restart it with, not a silent fallback: --max-lora-rank must be
one of vLLM's values and at least the adapter's rank, --max-loras at least max_staleness + 2 (the
trainer keeps max_staleness + 1 versions registered and loads the next one before unloading the
oldest). One push of `AdapterSync`:

    push(model, version v)
      write <output_dir>/.vllm_lora/<name>-v<v>-<run>  temp folder + rename: the server never reads half
                                                      a file; <run> is new for every AdapterSync
      POST /v1/load_lora_adapter <name>-v<v>          refused: the folder is removed, versions < v keep
                                                      serving, AdapterSyncError says what the server said
      POST /v1/unload_lora_adapter <name>-v<v-k-1>    k = max_staleness: v-k .. v stay registered, so a
                                                      rollout that started under any of them finishes
                                                      under it
      remove the folder of v-2k-2                     folders outlive their registration by k + 1 syncs

Versions are the trainer's `WeightVersion`s, and `<name>-v<v>` is `WeightVersion.adapter_name`: the
rollout process asks for the version it read when the rollout started (`AsyncRolloutLoop(lora_name=...)`),
and the trainer publishes version v only after `push(v)` returned, so the adapter a rollout names is
loaded. No pause is needed:
a new version is a new name, and requests under the older ones run on. The server reads the folder
itself, so `output_dir` must be on a file system it can see. Rank 0 only (the adapter of an unsharded
model is whole there).

Why a folder per run and why folders stay after the unload (vLLM 0.33, `entrypoints/openai/models/
serving.py`, `lora/worker_manager.py`, `v1/core/kv_cache_utils.py`): vLLM keys the prefix cache of a
LoRA request by (adapter name, path), so a resumed run that loaded its version 5 from the path an
earlier run's version 5 had would be served KV blocks of the earlier weights; a new path per run rules
that out. And vLLM's unload only forgets the name: the engine keeps the adapter in an LRU cache of
--max-cpu-loras entries and reloads an evicted one from its path when a request still running under
it is scheduled again, so the files stay one more staleness window after the unload.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.server_info import LoraServing
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.modeling.lora_rules import ALLOWED_MAX_RANKS, PLAIN_LORA_INITS, max_lora_ranks_for
from asyncgrpo.types import ADAPTER_NAME, WeightVersion, adapter_name_template

logger = logging.getLogger(__name__)

ADAPTER_DIR = ".vllm_lora"


# -- the choice at start (pure) --------------------------------------------------------------------

@dataclass(frozen=True)
class LoraSyncChoice:
    adapter_only: bool
    reason: str  # why, for the INFO line at start


def adapter_rank(peft_config: Any) -> int:
    """The largest rank among the adapter's modules (`r` and any `rank_pattern` value)."""
    return max(
        [int(peft_config.r), *(int(r) for r in (getattr(peft_config, "rank_pattern", None) or {}).values())]
    )


def _unservable(peft_config: Any) -> str | None:
    """Why the server cannot serve this adapter as an adapter (None: it can). vLLM 0.33 refuses the
    same features at load time (`PEFTHelper._validate_features`); routing them to merged sync here
    keeps the run going instead of failing its first sync."""
    c = peft_config
    if str(getattr(c, "peft_type", "")).rsplit(".", 1)[-1] != "LORA":
        return f"the adapter is {c.peft_type}, and servers load LoRA adapters only"
    init = getattr(c, "init_lora_weights", True)
    features = [
        (getattr(c, "use_dora", False), "DoRA adapters cannot be served as adapters"),
        (
            getattr(c, "modules_to_save", None),
            f"modules_to_save={c.modules_to_save} are full modules, not adapters",
        ),
        (
            getattr(c, "trainable_token_indices", None),
            "trainable_token_indices (embedding rows) cannot be served",
        ),
        (
            getattr(c, "bias", "none") != "none",
            f"bias={getattr(c, 'bias', None)!r} adapters cannot be served",
        ),
        (getattr(c, "lora_bias", False), "lora_bias adapters cannot be served as adapters"),
        (
            isinstance(init, str) and init.lower() not in PLAIN_LORA_INITS,
            f"init_lora_weights={init!r} also changes the base weights, which the server does not have",
        ),
        (getattr(c, "layer_replication", None), "layer_replication adapters cannot be served as adapters"),
        (
            getattr(c, "alora_invocation_tokens", None),
            "activated LoRA (alora_invocation_tokens) cannot be served",
        ),
        (getattr(c, "use_qalora", False), "QALoRA adapters cannot be served as adapters"),
        (getattr(c, "use_bdlora", None), "block-diagonal LoRA (use_bdlora) cannot be served as adapters"),
        (
            getattr(c, "target_parameters", None),
            "LoRA on raw parameters (target_parameters) is not served as adapters",
        ),
        (getattr(c, "fan_in_fan_out", False), "fan_in_fan_out adapters (Conv1D layers) cannot be served"),
    ]
    return next((why for present, why in features if present), None)


def restart_flags(rank: int, max_staleness: int, lora: LoraServing | None) -> str:
    """The server flags that serve an adapter of `rank` with `max_staleness`."""
    allowed = max_lora_ranks_for(rank)
    if not allowed:
        raise ValueError(
            f"LoRA rank {rank} is above the largest --max-lora-rank a server accepts "
            f"({ALLOWED_MAX_RANKS[-1]}): train with r <= {ALLOWED_MAX_RANKS[-1]}"
        )
    max_rank = lora.max_lora_rank if lora is not None and lora.max_lora_rank in allowed else allowed[0]
    max_loras = max(max_staleness + 2, lora.max_loras if lora is not None else 0)
    return f"--enable-lora --max-lora-rank {max_rank} --max-loras {max_loras}"


def choose_lora_sync(
    lora: LoraServing | None, peft_config: Any, *, max_staleness: int, sharded: bool, server_url: str
) -> LoraSyncChoice:
    """Adapter-only sync when the server serves LoRA at run time and this adapter fits it, merged
    otherwise. Raises `ValueError` naming the restart flags when the server serves LoRA with limits too
    small for this run."""
    rank = adapter_rank(peft_config)
    if lora is None:
        return LoraSyncChoice(False, (
            f"the server at {server_url} runs without LoRA; restart it with "
            f"{restart_flags(rank, max_staleness, None)} to sync only the adapter"
        ))
    if not lora.runtime_updating:
        return LoraSyncChoice(False, (
            f"the server at {server_url} runs with --enable-lora but without "
            "VLLM_ALLOW_RUNTIME_LORA_UPDATING=1, so it cannot load adapters at run time; restart it with "
            "that variable set to sync only the adapter"
        ))
    unservable = _unservable(peft_config)
    if unservable is not None:
        return LoraSyncChoice(False, unservable)
    if sharded:
        return LoraSyncChoice(False, "adapter-only sync of an FSDP-sharded model is not implemented")
    problems = []
    if lora.max_lora_rank not in ALLOWED_MAX_RANKS:
        problems.append(
            f"--max-lora-rank {lora.max_lora_rank} is not one of {', '.join(map(str, ALLOWED_MAX_RANKS))}"
        )
    elif lora.max_lora_rank < rank:
        problems.append(f"--max-lora-rank {lora.max_lora_rank} is below the adapter's rank {rank}")
    if lora.max_loras < max_staleness + 2:
        problems.append(
            f"--max-loras {lora.max_loras} is below max_staleness + 2 = {max_staleness + 2} (the trainer "
            f"keeps max_staleness + 1 = {max_staleness + 1} adapter versions registered and loads the next "
            "one before unloading the oldest)"
        )
    if problems:
        raise ValueError(
            f"the server at {server_url} serves LoRA adapters, but {'; '.join(problems)}. Restart it with "
            f"{restart_flags(rank, max_staleness, lora)} (or lower max_staleness / the LoRA r)"
        )
    return LoraSyncChoice(True, (
        f"the server at {server_url} serves LoRA adapters (--max-lora-rank {lora.max_lora_rank}, --max-loras "
        f"{lora.max_loras}); rank {rank}, {max_staleness + 1} versions kept"
    ))


# -- the transport ------------------------------------------------------------------------------

class AdapterSyncError(RuntimeError):
    """The server did not take a new adapter version (the previous ones keep serving)."""


def write_adapter(model: Any, folder: Path, dtype: torch.dtype) -> int:
    """Write `model`'s active LoRA adapter as a PEFT folder (adapter_config.json +
    adapter_model.safetensors, the adapter weights only, in `dtype`) at `folder`, atomically: written
    beside it and renamed into place (an older folder of that name is replaced). Returns its bytes."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    tmp = folder.parent / f".tmp-{folder.name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        adapter = model.active_adapter  # its weights and its config (PEFT's default is "default")
        state = get_peft_model_state_dict(model, adapter_name=adapter)
        tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in state.items()}
        save_file(tensors, str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        model.peft_config[adapter].save_pretrained(str(tmp))
        if folder.exists():
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return sum(f.stat().st_size for f in folder.iterdir())


class AdapterSync:
    """The weight transport of adapter-only sync: writes, loads and retires the adapter versions of one
    run (see the module docstring), the adapter in `dtype` (the serving dtype). Rank 0's."""

    def __init__(
        self,
        base_url: str,
        *,
        output_dir: str | Path,
        max_staleness: int,
        timeout_s: float,
        dtype: torch.dtype,
        api_key: str | None = None,
        name: str = ADAPTER_NAME,
    ) -> None:
        self.base_url = base_url
        self.dtype = dtype
        self.root = Path(output_dir) / ADAPTER_DIR
        self.keep = max_staleness + 1
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.name = name
        self.run_id = uuid.uuid4().hex[:8]  # in every folder name: a new path per run (module docstring)
        self.loaded: deque[WeightVersion] = deque()  # the versions registered on the server, oldest first
        self.on_disk: deque[WeightVersion] = deque()  # the versions whose folders exist, oldest first

    @property
    def lora_name(self) -> str:
        """The rollout process's `lora_name`: "{version}" is filled with a rollout's model version."""
        return adapter_name_template(self.name)

    def adapter_name(self, version: int) -> str:
        return WeightVersion(version).adapter_name(self.name)

    def folder(self, version: int) -> Path:
        return self.root / f"{self.adapter_name(version)}-{self.run_id}"

    def _call(self, work: Callable[[GenerationClient], Coroutine]) -> Any:
        async def run() -> Any:
            async with GenerationClient(
                self.base_url, timeout_s=self.timeout_s, api_key=self.api_key
            ) as client:
                return await work(client)

        return asyncio.run(run())

    def init(self) -> None:
        """Unload the adapters an earlier run of this name left on the server and remove their folders
        (a trainer restarted against a running server reuses the names)."""
        prefix = self.lora_name.partition("{version}")[0]

        async def unload_leftovers(client: GenerationClient) -> list[str]:
            names = [n for n in await client.served_adapters() if n.startswith(prefix)]
            for n in names:
                await client.unload_lora_adapter(n)
            return names

        left = self._call(unload_leftovers)
        if left:
            logger.info(
                "unloaded %d LoRA adapters left on the server by an earlier run: %s",
                len(left),
                ", ".join(left),
            )
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith((prefix, f".tmp-{prefix}")):
                    shutil.rmtree(path, ignore_errors=True)

    def push(self, model: Any, version: WeightVersion) -> dict[str, float]:
        """Serve `model`'s adapter as version `version`, then retire the versions that left the window.
        Returns the time split and size for `perf/weight_sync_*` (no pause: pause_s is 0; transfer_s =
        write_s + load_s, the folder written, then loaded by the server)."""
        t0 = time.perf_counter()
        version = WeightVersion(version)
        name, folder = version.adapter_name(self.name), self.folder(version)
        num_bytes = write_adapter(model, folder, self.dtype)
        t_written = time.perf_counter()
        try:
            self._call(lambda client: client.load_lora_adapter(name, str(folder.resolve())))
        except (ServerRequestError, ServerConnectionError, TimeoutError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            serving = (
                f"version {self.loaded[-1]} ({self.adapter_name(self.loaded[-1])})"
                if self.loaded
                else "no adapter"
            )
            hint = (
                f" The server could not find {folder}: put output_dir on a file system the server can read."
                if isinstance(exc, ServerRequestError) and exc.status == 404 else ""
            )
            raise AdapterSyncError(
                f"the server at {self.base_url} did not load LoRA adapter version {version} ({name}, "
                f"{folder}): {exc}. It keeps serving {serving}.{hint}"
            ) from exc
        self.loaded.append(version)
        self.on_disk.append(version)
        t_loaded = time.perf_counter()
        self._retire()
        t_done = time.perf_counter()
        logger.debug("LoRA adapter version %d: %d bytes, written in %.3fs, loaded in %.3fs",
                     version, num_bytes, t_written - t0, t_loaded - t_written)
        return {
            "pause_s": 0.0,
            "transfer_s": t_loaded - t0,
            "resume_s": 0.0,
            "total_s": t_done - t0,
            "write_s": t_written - t0,
            "load_s": t_loaded - t_written,
            "bytes": num_bytes,
            "num_chunks": 1,
        }

    def _retire(self) -> None:
        """Unload the versions beyond the newest max_staleness + 1; remove the folders beyond the newest
        2 * (max_staleness + 1) (the server may reload an unloaded version a running request still uses)."""
        old = []
        while len(self.loaded) > self.keep:
            old.append(self.loaded.popleft())

        async def unload(client: GenerationClient) -> None:
            for version in old:
                if not await client.unload_lora_adapter(self.adapter_name(version)):
                    logger.warning(
                        "LoRA adapter %s was already gone from the server", self.adapter_name(version)
                    )

        try:
            if old:
                self._call(unload)
        finally:
            while len(self.on_disk) > 2 * self.keep:
                shutil.rmtree(self.folder(self.on_disk.popleft()), ignore_errors=True)

    def close(self) -> None:
        """Unload every version still registered and remove the folders (the end of training, after the
        rollouts stopped; the checkpoints, not this cache, keep the trained adapter)."""
        self.keep = 0
        try:
            self._retire()
        except (ServerRequestError, ServerConnectionError, TimeoutError) as exc:
            logger.warning("unloading the LoRA adapters at the end of training failed (%s); the next run "
                           "unloads "
                           "them at its start", exc)

    def idle(self, model: Any, version: WeightVersion) -> None:
        """Nothing to do while the trainer waits (a restarted server is not watched: module docstring)."""

    def __str__(self) -> str:
        return "AdapterSync"
