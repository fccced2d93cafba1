import logging
from itertools import islice

import pytest
from datasets import Dataset

from asyncgrpo.data.prompts import (
    PromptItem,
    check_prompt,
    epoch_order,
    iter_prompts,
    row_reward_kwargs,
    validate_prompt_dataset,
)


def conv(i):
    return [{"role": "user", "content": f"q{i}"}]


def dataset(n=10):
    return Dataset.from_list([{"prompt": conv(i), "answer": str(i)} for i in range(n)])


def take(iterator, n):
    return list(islice(iterator, n))


def test_missing_prompt_column_says_how_to_add_one():
    ds = Dataset.from_list([{"question": "2+2?"}])
    with pytest.raises(ValueError, match="no 'prompt' column.*dataset.map"):
        validate_prompt_dataset(ds)
    validate_prompt_dataset(ds, prompt_required=False)  # environment_factory provides the prompt
    validate_prompt_dataset(ds, environment=True)


def test_plain_string_prompt_says_how_to_convert():
    ds = Dataset.from_list([{"prompt": "What is 2+2?"}])
    with pytest.raises(ValueError,
                       match=r"plain string.*dataset = dataset.map\(lambda row: \{'prompt': \[\{'role'"):
        validate_prompt_dataset(ds)
    with pytest.raises(ValueError, match="plain string"):
        validate_prompt_dataset(ds, prompt_required=False)


@pytest.mark.parametrize("prompt", [[], [{"content": "hi"}], ["hi"], None])
def test_malformed_messages_are_rejected(prompt):
    with pytest.raises(ValueError):
        check_prompt(prompt)


@pytest.mark.parametrize(
    "part,kind",
    [({"type": "image"}, "image"),
     ({"type": "image_url", "image_url": {"url": "https://x/cat.png"}}, "image_url"),
     ({"image": "cat.png"}, "image"),
     ({"type": "video", "video": "clip.mp4"}, "video"), (b"\x89PNG", "bytes")],
)
def test_image_content_is_refused_as_not_supported_yet(part, kind):
    prompt = [{"role": "system", "content": "You look at pictures."},
              {"role": "user", "content": [part, {"type": "text", "text": "What is in it?"}]}]
    with pytest.raises(ValueError, match=rf"\[1\] holds .*{kind}.* content; images are not supported yet"):
        validate_prompt_dataset([{"prompt": prompt}])
    rows = [{"prompt": conv(0)}, {"prompt": prompt}]  # a later row is refused when the stream reaches it
    with pytest.raises(ValueError, match=r"train_dataset\[1\]\['prompt'\]\[1\] holds"):
        list(iter_prompts(rows, seed=0, shuffle=False, max_epochs=1))


def test_text_parts_are_text():
    check_prompt([{"role": "user", "content": [{"type": "text", "text": "2+2?"}, "and 3+3?"]}])


def test_empty_dataset_and_reserved_columns_are_rejected():
    with pytest.raises(ValueError, match="empty"):
        validate_prompt_dataset([])
    with pytest.raises(ValueError, match="rename"):
        validate_prompt_dataset([{"prompt": conv(0), "completions": "x"}])


def test_a_bad_row_later_in_the_stream_is_named():
    rows = [{"prompt": conv(0)}, {"prompt": "oops"}]
    with pytest.raises(ValueError, match=r"train_dataset\[1\]\['prompt'\] is a plain string"):
        list(iter_prompts(rows, seed=0, shuffle=False, max_epochs=1))


def test_each_epoch_visits_every_row_once_in_a_seeded_order():
    items = list(iter_prompts(dataset(20), seed=3, max_epochs=3))
    assert [it.position for it in items] == list(range(60))
    epochs = [[it.row_index for it in items if it.epoch == e] for e in range(3)]
    assert all(sorted(order) == list(range(20)) for order in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[1] == list(epoch_order(20, 3, 1))
    assert [it.row_index for it in iter_prompts(dataset(20), seed=3, max_epochs=1)] == epochs[0]
    assert [it.row_index for it in iter_prompts(dataset(20), seed=4, max_epochs=1)] != epochs[0]
    assert all(it.row == {"prompt": conv(it.row_index), "answer": str(it.row_index)} for it in items)


def test_resume_continues_the_stream_exactly():
    full = take(iter_prompts(dataset(7), seed=1), 30)
    for start in (0, 5, 7, 13):
        resumed = take(iter_prompts(dataset(7), seed=1, start_position=start), 30 - start)
        assert resumed == full[start:]


def test_without_shuffle_rows_come_in_order():
    items = take(iter_prompts(dataset(3), seed=0, shuffle=False), 6)
    assert [(it.epoch, it.row_index) for it in items] == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2)]


def test_rejected_prompts_are_yielded_unaccepted_and_count_toward_the_epoch():
    calls = []

    def only_even(row_index, row, epoch):
        calls.append((row_index, row["answer"], epoch))
        return row_index % 2 == 0

    items = list(iter_prompts(dataset(4), seed=0, shuffle=False, filter_prompt=only_even, max_epochs=2))
    assert [it.accepted for it in items] == [True, False, True, False] * 2
    assert [it.position for it in items] == list(range(8))
    assert calls[:2] == [(0, "0", 0), (1, "1", 0)] and calls[4] == (0, "0", 1)


def test_an_epoch_with_every_prompt_rejected_raises():
    def reject_epoch_one(row_index, row, epoch):
        return epoch != 1

    stream = iter_prompts(dataset(3), seed=0, filter_prompt=reject_epoch_one)
    assert len(take(stream, 6)) == 6  # epoch 0 accepted, epoch 1 rejected (still yielded)
    with pytest.raises(ValueError, match="rejected all 3 prompts of epoch 1"):
        next(stream)


def test_a_partial_epoch_after_resume_may_be_all_rejected():
    stream = iter_prompts(dataset(3), seed=0, start_position=2, filter_prompt=lambda i, r, e: e > 0)
    assert [it.accepted for it in take(stream, 4)] == [False, True, True, True]


def test_iterable_dataset_is_read_in_order_and_restarts_on_resume(caplog):
    ds = dataset(4).to_iterable_dataset()
    with caplog.at_level(logging.WARNING, logger="asyncgrpo.data.prompts"):
        items = list(iter_prompts(ds, seed=0, start_position=6, max_epochs=2))
    assert "restarts from its first prompt" in caplog.text
    assert [(it.position, it.epoch, it.row_index) for it in items] == [
        (p, p // 4, p % 4) for p in range(8)
    ]
    assert items[5].row["answer"] == "1"
    assert isinstance(items[0], PromptItem)


def test_reward_kwargs_hold_every_other_column_once_per_rollout():
    assert row_reward_kwargs({"prompt": conv(0), "answer": "4", "task": "math"}, 3) == {
        "answer": ["4"] * 3, "task": ["math"] * 3
    }


def test_an_unknown_environment_name_is_caught_up_front():
    rows = [{"prompt": [{"role": "user", "content": "a"}], "environment": "math"},
            {"prompt": [{"role": "user", "content": "b"}], "environment": "maths"}]
    with pytest.raises(ValueError, match=r"train_dataset\[1\]\['environment'\] = 'maths' does not name"):
        validate_prompt_dataset(rows, environment=True, environment_names=["math", "code"])
    with pytest.raises(ValueError, match="no 'environment' column"):
        validate_prompt_dataset([{"prompt": rows[0]["prompt"]}], environment=True, environment_names=["math"])
    validate_prompt_dataset(rows[:1], environment=True, environment_names=["math", "code"])
    with pytest.raises(ValueError, match="'maths' does not name"):
        validate_prompt_dataset(Dataset.from_list(rows), environment=True, environment_names=["math"])
