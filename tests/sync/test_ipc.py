"""CUDA IPC wire forms (sync/ipc.py) that need no GPU: the JSON handle fields and their validation."""

from __future__ import annotations

import base64
import json

import pytest
import torch

from asyncgrpo.sync.ipc import IpcBuffer, embedded_update_info, parse_embedded_update
from asyncgrpo.sync.packed import TensorMeta


def handle(event: bytes | None = b"\x07" * 64) -> IpcBuffer:
    return IpcBuffer("GPU-1234", bytes(range(64)), 1 << 20, 512, b"/torch_1_2\x00", 8, event, True)


def test_handle_fields_survive_json_round_trip():
    for event in (b"\x07" * 64, None):
        shared = handle(event)
        assert IpcBuffer.from_json(json.loads(json.dumps(shared.to_json()))) == shared


def test_handle_bytes_travel_as_standard_base64():
    fields = handle().to_json()
    assert base64.b64decode(fields["storage_handle"]) == bytes(range(64))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"storage_handle": "not base64!"}, "not standard base64"),
        ({"storage_size_bytes": -1}, "integer >= 0"),
        ({"storage_offset_bytes": True}, "integer >= 0"),
        ({"device_uuid": ""}, "device_uuid"),
        ({"event_sync_required": "yes"}, "boolean"),
        ({"extra": 1}, "keys must be exactly"),
    ],
)
def test_bad_handle_fields_are_rejected_with_the_field(change, message):
    fields = {**handle().to_json(), **change}
    with pytest.raises(ValueError, match=message):
        IpcBuffer.from_json(fields)


def test_embedded_update_info_round_trips_metadata_and_handle():
    metas = [TensorMeta("a.weight", torch.bfloat16, (4, 8)), TensorMeta("b.bias", torch.float32, (3,))]
    info = json.loads(json.dumps(embedded_update_info(metas, handle())))
    got_metas, got_handle = parse_embedded_update(info)
    assert got_metas == metas and got_handle == handle()


def test_update_without_handle_or_names_is_rejected():
    with pytest.raises(ValueError, match="ipc_buffer"):
        parse_embedded_update({"names": [], "dtype_names": [], "shapes": []})
    with pytest.raises(ValueError, match="no reuse"):
        parse_embedded_update({"names": [], "dtype_names": [], "shapes": [],
                               "ipc_buffer": handle().to_json()})
