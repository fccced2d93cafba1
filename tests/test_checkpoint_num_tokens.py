"""rollout_state.json keeps num_tokens, so a resumed run goes on counting; older files read as 0."""

import json

import pytest

from asyncgrpo.checkpoint import RolloutState, read_rollout_state, write_rollout_state


def test_num_tokens_round_trips(tmp_path):
    write_rollout_state(tmp_path, RolloutState(3, 2, (5,), num_tokens=1234))
    assert read_rollout_state(tmp_path).num_tokens == 1234


def test_a_file_without_num_tokens_reads_as_zero(tmp_path):
    (tmp_path / "rollout_state.json").write_text(json.dumps({"trained_position": 3, "model_version": 2}))
    assert read_rollout_state(tmp_path).num_tokens == 0


def test_a_negative_num_tokens_is_refused():
    with pytest.raises(ValueError, match="num_tokens"):
        RolloutState(0, 0, num_tokens=-1)
