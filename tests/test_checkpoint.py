import json

import pytest

from asyncgrpo.checkpoint import ROLLOUT_STATE_FILE, RolloutState, read_rollout_state, write_rollout_state


def test_round_trip(tmp_path):
    path = write_rollout_state(tmp_path / "checkpoint-10",
                               RolloutState(trained_position=37, model_version=10))
    assert path.name == ROLLOUT_STATE_FILE
    assert json.loads(path.read_text()) == {
        "trained_position": 37, "model_version": 10, "trained_above": [], "num_tokens": 0
    }
    assert read_rollout_state(tmp_path / "checkpoint-10") == RolloutState(37, 10)
    assert [p.name for p in path.parent.iterdir()] == [ROLLOUT_STATE_FILE]  # no temp file left


def test_overwrite(tmp_path):
    write_rollout_state(tmp_path, RolloutState(1, 1))
    write_rollout_state(tmp_path, RolloutState(5, 2))
    assert read_rollout_state(tmp_path) == RolloutState(5, 2)


def test_checkpoint_without_state_reads_none(tmp_path):
    assert read_rollout_state(tmp_path) is None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "JSON object"),
        ('{"trained_position": 3}', "model_version"),
        ('{"trained_position": -1, "model_version": 0}', "trained_position must be a non-negative int"),
        ('{"trained_position": 1.5, "model_version": 0}', "trained_position"),
    ],
)
def test_bad_files_name_the_file_and_the_problem(tmp_path, text, match):
    (tmp_path / ROLLOUT_STATE_FILE).write_text(text)
    with pytest.raises(ValueError, match=match) as info:
        read_rollout_state(tmp_path)
    assert ROLLOUT_STATE_FILE in str(info.value)


def test_invalid_state_is_rejected_at_construction():
    with pytest.raises(ValueError, match="model_version"):
        RolloutState(trained_position=0, model_version=-2)
