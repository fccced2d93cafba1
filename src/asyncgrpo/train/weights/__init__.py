"""The trainer's weight push: the trained model -> a transport -> the server serves it as a `WeightVersion`.

    AsyncGRPOTrainer                                      (train/trainer.py)
      train():  weights = make_transport(link, info, model, settings); weights.init()     rank 0
                (the other ranks: make_transport(None, ...) -> OtherRank)
      a sync:   weights.push(model, version)   -> timings, perf/weight_sync_*          every rank
      waiting:  weights.idle(model, version)                                           rank 0
      end:      weights.close()

    choose.py      make_transport, the one factory: which transport, from the trainer's device, the
                   model (PEFT, sharded) and what the server reports; `choose_transport` (pure)
    base.py        the `WeightTransport` protocol; `FullWeights`, the base of the transports that send
                   every weight (push = gather + send); `OtherRank`
    gather.py      the weights the server receives (`weights_for_server`, the metas) and the push
                   through a transport's `send`, FSDP2 bucket by bucket on every rank
    collective.py  `CollectiveTransport`: NCCL or gloo, it owns the `WeightSender`
    delta.py       `LastPush`: the copy of the last push a weight delta is taken against (weight_push="delta")
    ipc.py         `IpcTransport`: CUDA IPC on the server's GPU (embedded server or vLLM's ipc backend)
    adapters.py    `AdapterSync`: LoRA adapter-only sync (files the server loads), and whether a PEFT run
                   can use it (`choose_lora_sync`)
    restarts.py    `ServerRestarts`: wraps a full-weight transport; a server that restarted gets the
                   transfer set up again and the weights back
    every_server.py  `EveryServer`: several servers, one transport each (`choose.make_transports`),
                   all paused, pushed one after the other, resumed

`ServerLink` (train/server_link.py) is the HTTP side the transports share: the client and its event
loop, the trainer lease, and the pause around a push. The wire format of both sides is `asyncgrpo.sync`.
"""

from asyncgrpo.train.weights.base import WeightTransport
from asyncgrpo.train.weights.choose import WeightSettings, make_transport

__all__ = ["WeightSettings", "WeightTransport", "make_transport"]
