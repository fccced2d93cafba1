"""TrainedPrompts: epoch accounting and the resume position."""

from asyncgrpo.train.progress import TrainedPrompts


def test_prompt_is_done_only_after_marker_and_all_samples():
    p = TrainedPrompts()
    p.on_sample_consumed(0)
    assert p.trained_position == 0  # marker not seen yet: more samples may follow
    p.on_group_finished(0, 2)
    assert p.trained_position == 0  # one of two samples trained
    p.on_sample_consumed(0)
    assert p.trained_position == 1 and p.num_done == 1


def test_dropped_group_counts_toward_the_epoch():
    p = TrainedPrompts()
    p.on_group_finished(0, 0)
    assert p.trained_position == 1 and p.num_done == 1


def test_trained_position_waits_for_the_oldest_prompt():
    p = TrainedPrompts()
    p.on_group_finished(1, 0)
    p.on_group_finished(2, 1)
    p.on_sample_consumed(2)
    assert p.num_done == 2
    assert p.trained_position == 0  # prompt 0 generated earlier but not trained: resume must redo it
    p.on_group_finished(0, 1)
    p.on_sample_consumed(0)
    assert p.trained_position == 3


def test_resume_start_position():
    p = TrainedPrompts(start_position=10)
    assert p.trained_position == 10
    p.on_group_finished(10, 0)
    assert p.trained_position == 11
