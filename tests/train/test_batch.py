import pytest
import torch

from dsv4rl.samples import Sample
from dsv4rl.train.batch import TrainBatch

PAD = 2


def sample(prompt, response, adv=0.0):
    lps = [-0.1 * (k + 1) for k in range(len(response))]
    return Sample(0, prompt, response, lps, "", "stop", advantage=adv)


def test_alignment_hand_example():
    # prompt [10, 11, 12] (P=3), response [20, 21] -> targets 20, 21 at indices 2, 3
    b = TrainBatch.from_samples(
        [sample([10, 11, 12], [20, 21], 1.5), sample([10], [30, 31, 32, 33], -1.0)], PAD
    )
    assert b.input_ids.tolist() == [[10, 11, 12, 20, 21], [10, 30, 31, 32, 33]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1], [1, 1, 1, 1]]
    assert b.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1, -0.2])
    assert b.rollout_logprobs[1].tolist() == pytest.approx([-0.1, -0.2, -0.3, -0.4])
    assert b.advantages.tolist() == [1.5, -1.0]
    # the mask selects exactly the response tokens as targets
    for i, resp in enumerate([[20, 21], [30, 31, 32, 33]]):
        assert b.input_ids[i, 1:][b.loss_mask[i].bool()].tolist() == resp


def test_padding_right_with_pad_id():
    b = TrainBatch.from_samples([sample([5, 6], [7]), sample([5, 6, 8, 9], [7, 7, 7])], PAD)
    assert b.input_ids.tolist() == [[5, 6, 7, PAD, PAD, PAD, PAD], [5, 6, 8, 9, 7, 7, 7]]
    assert b.loss_mask.tolist() == [[0, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1]]
    assert b.rollout_logprobs[0, 2:].abs().sum() == 0
    assert b.input_ids.dtype == torch.long and b.loss_mask.dtype == torch.float32
    assert b.num_tokens == 4


def test_empty_response_and_errors():
    b = TrainBatch.from_samples([sample([5], [])], PAD)
    assert b.input_ids.shape == (1, 2) and b.num_tokens == 0
    with pytest.raises(ValueError, match="empty prompt"):
        TrainBatch.from_samples([sample([], [1])], PAD)
    bad = sample([5], [1, 2])
    bad.rollout_logprobs = [0.0]
    with pytest.raises(ValueError, match="rollout logprobs"):
        TrainBatch.from_samples([bad], PAD)
    with pytest.raises(ValueError, match="shape"):
        TrainBatch(torch.zeros(2, 4, dtype=torch.long), torch.zeros(2, 4), torch.zeros(2), torch.zeros(2, 3))


def _numbered(n):
    return TrainBatch.from_samples([sample([1, 2], [3] * (i % 3 + 1), float(i)) for i in range(n)], PAD)


def test_shard_contiguous_and_divisibility():
    b = _numbered(8)
    shards = [b.shard(r, 4) for r in range(4)]
    assert [s.advantages.tolist() for s in shards] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert torch.equal(torch.cat([s.input_ids for s in shards]), b.input_ids)
    assert torch.equal(torch.cat([s.loss_mask for s in shards]), b.loss_mask)
    with pytest.raises(ValueError, match="does not split"):
        b.shard(0, 3)
    with pytest.raises(ValueError, match="outside"):
        b.shard(2, 2)


def test_shard_by_mini_batch_keeps_global_mini_batches():
    b = _numbered(8)
    # 2 mini-batches {0..3}, {4..7}; rank r takes its half of each
    assert b.shard(0, 2, num_mini_batches=2).advantages.tolist() == [0, 1, 4, 5]
    assert b.shard(1, 2, num_mini_batches=2).advantages.tolist() == [2, 3, 6, 7]
    mb0 = [b.shard(r, 2, num_mini_batches=2).split(2)[0] for r in range(2)]
    assert sorted(sum((m.advantages.tolist() for m in mb0), [])) == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="mini-batch"):
        b.shard(0, 2, num_mini_batches=3)


def test_micro_batches_trim_and_to():
    b = _numbered(5)
    micro = list(b.micro_batches(2))
    assert [m.size for m in micro] == [2, 2, 1]
    assert torch.equal(torch.cat([m.input_ids for m in micro]), b.input_ids)
    with pytest.raises(ValueError):
        next(b.micro_batches(0))
    short = TrainBatch.from_samples([sample([1, 2], [3]), sample([1, 2], [3])], PAD)
    padded = TrainBatch(
        torch.cat([short.input_ids, torch.full((2, 3), PAD)], 1),
        torch.cat([short.loss_mask, torch.zeros(2, 3)], 1),
        short.advantages,
        torch.cat([short.rollout_logprobs, torch.zeros(2, 3)], 1),
    )
    t = padded.trimmed()
    assert torch.equal(t.input_ids, short.input_ids) and torch.equal(t.loss_mask, short.loss_mask)
    moved = b.to("cpu")
    assert moved.old_logprobs is None and moved.input_ids.device.type == "cpu"


def test_an_excluded_sample_carries_no_loss():
    """A sample no reward function scored stays in the batch (whole groups) with its loss masked out."""
    kept = Sample(0, [1, 2], [3, 4], [-0.1, -0.2], "", "stop")
    excluded = Sample(0, [1, 2], [5], [-0.3], "", "stop", excluded=True)
    batch = TrainBatch.from_samples([kept, excluded], pad_id=0)
    assert batch.loss_mask.tolist() == [[0.0, 1.0, 1.0], [0.0, 0.0, 0.0]]
    assert batch.num_tokens == 2


def test_a_bad_loss_mask_names_its_own_sample():
    """The loss-mask check names the sample that is wrong, not the last one the first check looked at."""
    good = sample([5], [1, 2])
    bad = sample([5], [1, 2])
    bad.loss_mask = [1.0]
    last = sample([5], [3])
    with pytest.raises(ValueError, match=r"^sample 1 has 2 response tokens but a loss mask of 1$"):
        TrainBatch.from_samples([good, bad, last], PAD)
