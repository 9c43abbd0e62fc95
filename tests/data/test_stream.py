import pytest

from dsv4rl.config.schema import ArithDataConfig, Config
from dsv4rl.data import ArithProblems, Problem, PromptStream, build_prompt_stream


def _problems(n: int) -> list[Problem]:
    return [Problem(prompt=f"p{i}", answer=str(i), id=str(i)) for i in range(n)]


def _ids(batch):
    return [p.id for p in batch]


def test_resume_gives_the_same_next_batches():
    source = ArithProblems(ArithDataConfig(max_operand=4, ops=["+", "*"], max_answer=9), seed=3)
    stream = PromptStream(source, batch_size=7, seed=11, shuffle=True)
    for _ in range(3):
        stream.next_batch()
    state = stream.state_dict()
    expected = [_ids(stream.next_batch()) for _ in range(2)]

    resumed = PromptStream(source, batch_size=7, seed=11, shuffle=True)
    resumed.load_state_dict(state)
    assert [_ids(resumed.next_batch()) for _ in range(2)] == expected
    # A fresh stream without the state starts over, so the check above is not vacuous.
    assert _ids(PromptStream(source, batch_size=7, seed=11).next_batch()) != expected[0]


def test_epochs_cover_every_problem_once_and_cross_boundaries():
    stream = PromptStream(_problems(10), batch_size=4, seed=0)
    batches = [_ids(next(stream)) for _ in range(5)]  # 20 items = 2 epochs
    flat = [x for b in batches for x in b]
    assert sorted(flat[:10]) == sorted(map(str, range(10)))
    assert sorted(flat[10:]) == sorted(map(str, range(10)))
    assert flat[:10] != flat[10:]  # reshuffled per epoch
    assert stream.epoch == 2 and stream.position == 0


def test_no_shuffle_keeps_order_and_seed_changes_order():
    assert _ids(PromptStream(_problems(5), 5, shuffle=False).next_batch()) == ["0", "1", "2", "3", "4"]
    a = _ids(PromptStream(_problems(50), 50, seed=1).next_batch())
    b = _ids(PromptStream(_problems(50), 50, seed=2).next_batch())
    assert a != b and sorted(a) == sorted(b)


def test_batch_larger_than_dataset():
    batch = PromptStream(_problems(3), batch_size=7, seed=0).next_batch()
    assert len(batch) == 7


def test_load_state_rejects_other_data():
    stream = PromptStream(_problems(10), 4, seed=0)
    stream.next_batch()
    state = stream.state_dict()
    with pytest.raises(ValueError, match="num_problems"):
        PromptStream(_problems(11), 4, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptStream(_problems(10), 4, seed=1).load_state_dict(state)


def test_invalid_arguments():
    with pytest.raises(ValueError, match="batch_size"):
        PromptStream(_problems(3), 0)
    with pytest.raises(ValueError, match="empty"):
        PromptStream([], 2)


def test_build_prompt_stream_from_config():
    cfg = Config()
    cfg.algo.prompts_per_step = 5
    stream = build_prompt_stream(cfg)
    assert len(stream.next_batch()) == 5 and len(stream.problems) == 25
    assert stream.seed == cfg.seed and stream.shuffle == cfg.data.shuffle
