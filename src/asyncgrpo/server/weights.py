"""Receiving side of weight sync: the weight-transfer state machine and loading tensors into the model.

    /init_weight_transfer_engine  -> WeightTransfer.init      (worker thread; joins the group)
    /start_weight_update          -> WeightTransfer.start     (state check)
    /update_weights               -> WeightTransfer.update    (engine thread: receive + copy)
    /finish_weight_update         -> WeightTransfer.finish    (the caller sets the version)
    /shutdown_weight_transfer_engine -> WeightTransfer.shutdown

Names are Hugging Face checkpoint names (`model.layers.3.self_attn.q_proj.weight`,
`lm_head.weight`); tied embeddings resolve to the same tensor. Every payload is checked against the
model BEFORE receiving, so a bad request fails fast (the sender must not broadcast into it).

A delta update (an embedded-server extension, `asyncgrpo.sync.delta`) carries only the changed words
and applies them in place, as a full update copies in place (the parameters' storage, which fused
layers and CUDA graphs read, stays the same). It is rejected (`WeightDeltaRejected`, HTTP 412) when
the server holds another weight version than the delta's base, or when a tensor's sketch differs from
the trainer's once applied; either way after receiving all of it, so the group stays in step, and the
trainer pushes the full weights next. The loader keeps each parameter's sketch from the first delta
after a full load on (computed over the whole tensor once, then moved by the changed words alone).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from asyncgrpo.sync.delta import Sketch, TensorDelta, apply_delta, read_at, sketch_update, tensor_sketch

logger = logging.getLogger(__name__)


class WeightTransferError(RuntimeError):
    """A weight-transfer request in the wrong state or with a bad payload (HTTP 500, like vLLM)."""


class WeightDeltaRejected(WeightTransferError):
    """A weight delta this server does not take (HTTP 412): it applies to another weight version than the
    one held, or it leaves tensors that differ from the trainer's. Raised only once the whole delta was
    received; the trainer pushes the full weights instead."""


class WeightLoader:
    """Copies named tensors into the model's parameters (in place, same dtype and shape)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self._params: dict[str, torch.nn.Parameter] = dict(model.named_parameters(remove_duplicate=False))
        # id(parameter) -> the sketch of its bits (tied names share one parameter); a full load drops it
        self._sketches: dict[int, Sketch] = {}

    def names(self) -> list[str]:
        return list(self._params)

    def check(self, names: list[str], dtype_names: list[str], shapes: list[list[int]]) -> None:
        """Validate an update_info payload against the model; raises WeightTransferError."""
        if not (len(names) == len(dtype_names) == len(shapes)):
            raise WeightTransferError(
                f"update_info lists differ in length: names={len(names)}, dtype_names={len(dtype_names)}, "
                f"shapes={len(shapes)}"
            )
        problems = []
        for name, dtype_name, shape in zip(names, dtype_names, shapes):
            param = self._params.get(name)
            if param is None:
                problems.append(f"unknown parameter {name!r}")
                continue
            dtype = getattr(torch, str(dtype_name), None)
            if not isinstance(dtype, torch.dtype):
                problems.append(f"{name}: unknown dtype name {dtype_name!r}")
            elif dtype != param.dtype:
                problems.append(f"{name}: dtype {dtype_name} but the server holds {param.dtype} (send the "
                                "serving dtype)")
            if list(shape) != list(param.shape):
                problems.append(f"{name}: shape {list(shape)} but the server holds {list(param.shape)}")
        if problems:
            shown = "; ".join(problems[:5]) + (f"; ... {len(problems) - 5} more" if len(problems) > 5 else "")
            raise WeightTransferError(f"update_info does not match the served model: {shown}")

    def _param(self, name: str) -> torch.nn.Parameter:
        param = self._params.get(name)
        if param is None:
            raise WeightTransferError(f"unknown parameter {name!r}; names are Hugging Face checkpoint names")
        return param

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        param = self._param(name)
        if tensor.shape != param.shape or tensor.dtype != param.dtype:
            raise WeightTransferError(
                f"{name}: received shape {tuple(tensor.shape)} dtype {tensor.dtype}, the server holds shape "
                f"{tuple(param.shape)} dtype {param.dtype}"
            )
        param.copy_(tensor)
        self._sketches.pop(id(param), None)

    @torch.no_grad()
    def load_delta(self, name: str, delta: TensorDelta) -> None:
        """Apply one tensor's delta in place (a whole tensor is a full load); the parameter's sketch, when
        known, moves by the changed words."""
        param = self._param(name)
        if delta.indices is None:
            self.load(name, delta.values)
            return
        if delta.values.dtype != param.dtype:
            raise WeightTransferError(f"{name}: delta values are {delta.values.dtype}, the server holds "
                                      f"{param.dtype}")
        known = self._sketches.get(id(param))
        old = read_at(param, delta.indices) if known is not None else None
        apply_delta(param, delta)
        if known is not None:
            self._sketches[id(param)] = sketch_update(known, delta.indices, old, delta.values, param.numel())

    def sketch(self, name: str) -> Sketch:
        """The sketch of the parameter's bits as they are (`asyncgrpo.sync.delta`), over the whole tensor
        when not known yet."""
        param = self._param(name)
        known = self._sketches.get(id(param))
        if known is None:
            known = self._sketches[id(param)] = tensor_sketch(param)
        return known

    def load_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        n = 0
        for name, tensor in items:
            self.load(name, tensor)
            n += 1
        return n


class WeightTransfer:
    """State machine of the weight-transfer routes around a WeightReceiver (asyncgrpo.sync)."""

    def __init__(self, device: torch.device, loader: WeightLoader, timeout_s: float) -> None:
        self.device = device
        self.loader = loader
        self.timeout_s = timeout_s  # bounds joining the group and every receive (--weight-transfer-timeout)
        self.receiver = None
        self.in_process = False  # the server runs inside the trainer's process (serve.ServerThread)
        self.active = False
        self._last_info: dict | None = None

    def init(self, init_info: dict) -> None:
        """Blocking: create the receiver and join the sender's group (run off the event loop)."""
        if self.active:
            raise WeightTransferError("a weight update is in progress; finish it before re-initialising")
        try:
            from asyncgrpo.sync.receiver import WeightReceiver
        except ImportError as exc:
            raise WeightTransferError(
                f"weight transfer is unavailable: cannot import asyncgrpo.sync.receiver ({exc})"
            ) from exc
        if not isinstance(init_info, dict):
            raise WeightTransferError("Invalid init_info: expected a JSON object")
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None
        if self.in_process and init_info.get("backend") != "ipc":
            raise WeightTransferError(
                "this server runs inside the trainer's process, which cannot also be the other rank of a "
                f"{'gloo' if self.device.type == 'cpu' else 'NCCL'} group: it takes weights over CUDA IPC "
                "only (trainer and server on one GPU); put the trainer on the server's GPU, or start the "
                "server as its own process (asyncgrpo serve)")
        if init_info.get("backend") == "ipc":  # the trainer shares this GPU (asyncgrpo.sync.ipc)
            if self.device.type != "cuda":
                raise WeightTransferError(
                    f"the ipc weight-transfer backend needs a CUDA server; this one runs on {self.device}: "
                    "use gloo"
                )
            from asyncgrpo.sync.ipc import IpcReceiver

            receiver = IpcReceiver(self.device)
        else:
            receiver = WeightReceiver(device=self.device, timeout_s=self.timeout_s)
        try:
            receiver.init(init_info)
        except (ValueError, RuntimeError) as exc:  # bad init_info, or the trainer's group could not be joined
            raise WeightTransferError(str(exc)) from exc
        self.receiver = receiver

    def start(self) -> None:
        if self.receiver is None:
            raise WeightTransferError(
                "Weight transfer engine is not initialized; call /init_weight_transfer_engine first"
            )
        if self.active:
            raise WeightTransferError("A weight update is already active; call /finish_weight_update first")
        self.active = True

    def update(self, update_info, weight_version: str | None = None) -> int:
        """Blocking (engine thread): validate, receive every tensor, load it. Returns the count.
        `weight_version`: the version the server holds (what a delta update must apply to)."""
        if not self.active:
            raise WeightTransferError("No weight update is active; call /start_weight_update first")
        info = update_info
        if isinstance(info, list) and len(info) == 1:
            info = info[0]
        if isinstance(info, dict):
            names, dtypes, shapes = (info.get(k) for k in ("names", "dtype_names", "shapes"))
            if not all(isinstance(x, list) for x in (names, dtypes, shapes)):
                raise WeightTransferError("update_info needs the lists names, dtype_names and shapes")
            if not names and not dtypes and not shapes:
                if self._last_info is None:
                    raise WeightTransferError(
                        "empty update_info reuses the previous metadata, but there is none")
                names, dtypes, shapes = (self._last_info[k] for k in ("names", "dtype_names", "shapes"))
            self.loader.check(names, dtypes, shapes)
            self._last_info = {"names": names, "dtype_names": dtypes, "shapes": shapes}
            if "delta" in info:
                return self._update_delta(info, weight_version)
        try:
            n = self.loader.load_all(self.receiver.receive(update_info))
        except ValueError as exc:
            raise WeightTransferError(str(exc)) from exc
        logger.info("loaded %d tensors", n)
        return n

    def _update_delta(self, update_info: dict, weight_version: str | None) -> int:
        """Receive a delta update to its end, then apply it if its base is the version held, and check every
        tensor's sketch against the trainer's (module docstring)."""
        receive_delta = getattr(self.receiver, "receive_delta", None)
        if receive_delta is None:
            raise WeightTransferError(
                "weight deltas travel over the gloo or NCCL group only, and this transfer is CUDA IPC: send "
                "the full weights")
        try:
            metas, info, deltas = receive_delta(update_info)
        except ValueError as exc:
            raise WeightTransferError(str(exc)) from exc
        if info.base_version != weight_version:
            for _ in deltas:  # received to the end and dropped: the group stays in step
                pass
            raise WeightDeltaRejected(
                f"the weight delta applies to version {info.base_version!r} and this server holds "
                f"{weight_version!r}: push the full weights")
        n = 0
        for meta, delta in deltas:
            self.loader.load_delta(meta.name, delta)
            n += 1
        wrong = [m.name for m, sketch in zip(metas, info.sketches) if self.loader.sketch(m.name) != sketch]
        if wrong:
            raise WeightDeltaRejected(
                f"after the weight delta {len(wrong)} of {len(metas)} tensors differ from the trainer's "
                f"({', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}): the base this server held was "
                "not the trainer's last push; push the full weights")
        logger.info("applied a weight delta to %d of %d tensors", n, len(metas))
        return n

    def finish(self) -> None:
        if not self.active:
            raise WeightTransferError("No weight update is active; call /start_weight_update first")
        self.active = False
        self.receiver.end_update()

    def store_address(self) -> tuple[str, int] | None:
        """(host, port) of the trainer's TCPStore of a gloo group (None for NCCL or no group)."""
        config = self.receiver.config if self.receiver is not None else None
        if config is None or config.backend != "gloo":
            return None
        return config.master_address, config.master_port

    def abandon(self) -> None:
        """Drop the group and any unfinished update (its sender is gone; blocking: run off the loop)."""
        self.active = False
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None

    def shutdown(self) -> None:
        if self.active:
            raise WeightTransferError("cannot shut down the weight transfer engine during an update")
        if self.receiver is not None:
            self.receiver.shutdown()
            self.receiver = None
