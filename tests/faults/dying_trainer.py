"""A trainer killed in the middle of a weight sync: it joins the server's weight-transfer group,
pauses the server, starts an update, then SIGKILLs itself (run by test_trainer_lease.py).

    python dying_trainer.py URL
"""

from __future__ import annotations

import os
import signal
import sys

import torch

from asyncgrpo.train.server_link import ServerLink
from asyncgrpo.train.weights.collective import CollectiveTransport

link = ServerLink(sys.argv[1], timeout_s=60)
link.connect()
# held in a variable: its group lives until the kill
transport = CollectiveTransport(link, torch.device("cpu"), torch.float32)
transport.init()
link._run(link.client.pause(mode="keep", clear_cache=True, lease_s=60))  # outlives this process
link._run(link.client.start_weight_update())
print("MID-UPDATE", flush=True)
os.kill(os.getpid(), signal.SIGKILL)
