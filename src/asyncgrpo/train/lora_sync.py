"""Adapter-only weight sync: each sync writes the LoRA adapter to disk and has the server load it.

    push(model, version v)
      write <output_dir>/.vllm_lora/<name>-v<v>-<run>  temp folder + rename: the server never reads half
                                                      a file; <run> is new for every AdapterSync
      POST /v1/load_lora_adapter <name>-v<v>          refused: the folder is removed, versions < v keep
                                                      serving, AdapterSyncError says what the server said
      POST /v1/unload_lora_adapter <name>-v<v-k-1>    k = max_staleness: v-k .. v stay registered, so a
                                                      rollout that started under any of them finishes
                                                      under it
      remove the folder of v-2k-2                     folders outlive their registration by k + 1 syncs

Versions are the trainer's model versions: the rollout process asks for `<name>-v{version}` with the
version it read when the rollout started (`AsyncRolloutLoop(lora_name=...)`), and the trainer publishes
version v only after `push(v)` returned, so the adapter a rollout names is loaded. No pause is needed:
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
from pathlib import Path
from typing import Any

import torch

from asyncgrpo.generation.client import GenerationClient
from asyncgrpo.generation.server_info import LoraServing
from asyncgrpo.generation.transport import ServerConnectionError, ServerRequestError
from asyncgrpo.train.lora_mode import choose_lora_sync

logger = logging.getLogger(__name__)

ADAPTER_DIR = ".vllm_lora"
ADAPTER_NAME = "asyncgrpo-lora"


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
    """Writes, loads and retires the adapter versions of one run (see the module docstring)."""

    def __init__(
        self,
        base_url: str,
        *,
        output_dir: str | Path,
        max_staleness: int,
        timeout_s: float,
        api_key: str | None = None,
        name: str = ADAPTER_NAME,
    ) -> None:
        self.base_url = base_url
        self.root = Path(output_dir) / ADAPTER_DIR
        self.keep = max_staleness + 1
        self.timeout_s = timeout_s
        self.api_key = api_key
        self.name = name
        self.run_id = uuid.uuid4().hex[:8]  # in every folder name: a new path per run (module docstring)
        self.loaded: deque[int] = deque()  # the versions registered on the server, oldest first
        self.on_disk: deque[int] = deque()  # the versions whose folders exist, oldest first

    @property
    def name_template(self) -> str:
        """The rollout process's `lora_name`: "{version}" is filled with a rollout's model version."""
        return f"{self.name}-v{{version}}"

    def adapter_name(self, version: int) -> str:
        return f"{self.name}-v{version}"

    def folder(self, version: int) -> Path:
        return self.root / f"{self.adapter_name(version)}-{self.run_id}"

    def _call(self, work: Callable[[GenerationClient], Coroutine]) -> Any:
        async def run() -> Any:
            async with GenerationClient(self.base_url, timeout_s=self.timeout_s, api_key=self.api_key) as client:
                return await work(client)

        return asyncio.run(run())

    def start(self) -> None:
        """Unload the adapters an earlier run of this name left on the server and remove their folders
        (a trainer restarted against a running server reuses the names)."""
        prefix = f"{self.name}-v"

        async def unload_leftovers(client: GenerationClient) -> list[str]:
            names = [n for n in await client.served_adapters() if n.startswith(prefix)]
            for n in names:
                await client.unload_lora_adapter(n)
            return names

        left = self._call(unload_leftovers)
        if left:
            logger.info("unloaded %d LoRA adapters left on the server by an earlier run: %s", len(left), ", ".join(left))
        if self.root.is_dir():
            for path in self.root.iterdir():
                if path.name.startswith((prefix, f".tmp-{prefix}")):
                    shutil.rmtree(path, ignore_errors=True)

    def push(self, model: Any, *, version: int, dtype: torch.dtype) -> dict[str, float]:
        """Serve `model`'s adapter as version `version`, then retire the versions that left the window.
        Returns the time split and size for `perf/weight_sync_*` (no pause: pause_s is 0; transfer_s =
        write_s + load_s, the folder written, then loaded by the server)."""
        t0 = time.perf_counter()
        name, folder = self.adapter_name(version), self.folder(version)
        num_bytes = write_adapter(model, folder, dtype)
        t_written = time.perf_counter()
        try:
            self._call(lambda client: client.load_lora_adapter(name, str(folder.resolve())))
        except (ServerRequestError, ServerConnectionError, TimeoutError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            serving = f"version {self.loaded[-1]} ({self.adapter_name(self.loaded[-1])})" if self.loaded else "no adapter"
            hint = (
                f" The server could not find {folder}: put output_dir on a file system the server can read."
                if isinstance(exc, ServerRequestError) and exc.status == 404 else ""
            )
            raise AdapterSyncError(
                f"the server at {self.base_url} did not load LoRA adapter version {version} ({name}, {folder}): "
                f"{exc}. It keeps serving {serving}.{hint}"
            ) from exc
        self.loaded.append(version)
        self.on_disk.append(version)
        t_loaded = time.perf_counter()
        self._retire()
        t_done = time.perf_counter()
        logger.debug("LoRA adapter version %d: %d bytes, written in %.3fs, loaded in %.3fs",
                     version, num_bytes, t_written - t0, t_loaded - t_written)
        return {"pause_s": 0.0, "transfer_s": t_loaded - t0, "resume_s": 0.0, "total_s": t_done - t0,
                "write_s": t_written - t0, "load_s": t_loaded - t_written, "bytes": num_bytes, "num_chunks": 1}

    def _retire(self) -> None:
        """Unload the versions beyond the newest max_staleness + 1; remove the folders beyond the newest
        2 * (max_staleness + 1) (the server may reload an unloaded version a running request still uses)."""
        old = []
        while len(self.loaded) > self.keep:
            old.append(self.loaded.popleft())

        async def unload(client: GenerationClient) -> None:
            for version in old:
                if not await client.unload_lora_adapter(self.adapter_name(version)):
                    logger.warning("LoRA adapter %s was already gone from the server", self.adapter_name(version))

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
            logger.warning("unloading the LoRA adapters at the end of training failed (%s); the next run unloads "
                           "them at its start", exc)


def start_adapter_sync(
    peft_config: Any,
    lora: LoraServing | None,
    *,
    base_url: str,
    output_dir: str | Path,
    max_staleness: int,
    timeout_s: float,
    api_key: str | None,
    sharded: bool,
) -> AdapterSync | None:
    """At start, for a PEFT run (`peft_config` not None): an `AdapterSync` ready to push when the server
    serves LoRA adapters at run time, None for merged sync; an INFO line says which and why. Raises
    `ValueError` with the restart flags when the server's LoRA limits are too small for the run."""
    if peft_config is None:
        return None
    choice = choose_lora_sync(lora, peft_config, max_staleness=max_staleness, sharded=sharded, server_url=base_url)
    logger.info("PEFT weight sync: %s (%s)", "adapter only" if choice.adapter_only else "merged", choice.reason)
    if not choice.adapter_only:
        return None
    sync = AdapterSync(base_url, output_dir=output_dir, max_staleness=max_staleness, timeout_s=timeout_s,
                       api_key=api_key)
    sync.start()
    return sync
