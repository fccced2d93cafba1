"""A trainer that holds a pause while the test freezes the server (run by test_frozen_server_pause.py):
it joins the weight-transfer group, pauses the server with a lease, says PAUSED, waits for a line on
stdin, then tries a weight sync that the frozen server cannot answer, fails on its timeout and exits.

    python pausing_trainer.py URL LEASE_S TIMEOUT_S
"""

from __future__ import annotations

import sys

import torch
from fault_helpers import MODEL

from asyncgrpo.modeling.load import load_causal_lm
from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.collective import CollectiveTransport

url, lease_s, timeout_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
weights = [(n, p.detach()) for n, p in load_causal_lm(MODEL, dtype=torch.float32).named_parameters()]
link = ServerLink(url, timeout_s=timeout_s)
link.connect()
transport = CollectiveTransport(link, torch.device("cpu"), torch.float32)
transport.init()
link._run(link.client.pause(mode="keep", lease_s=lease_s))
print("PAUSED", flush=True)
sys.stdin.readline()  # the server is frozen now
try:
    transport.send(iter(weights), label="during-the-freeze")
    print("SENT", flush=True)
except Exception as exc:  # noqa: BLE001 -- reported to the test, as a trainer's failure
    print(f"FAILED {type(exc).__name__}: {exc}"[:400], flush=True)
finally:
    try:
        transport.close()
    finally:
        link.close()
print("EXITING", flush=True)
