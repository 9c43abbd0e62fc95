"""One rollout batch -> `algo.updates_per_step` optimizer steps, written once for every trainer backend.

The order of a train step is the same whatever trains: check the batch, take the reference and old-policy
log-probs, then per mini-batch all-reduce the loss normaliser, run forward + backward over its micro-batches
with the shared loss (`dsv4rl.algo.loss`), take an optimizer step at the schedule's learning rate, and
finally reduce the step's sums into metrics. A backend (`fsdp`, `megatron`) supplies only the parts that
differ: how a mini-batch is cut into micro-batches, how those are run forward (and backward), the
optimizer step, and which of its ranks hold the copy of each sum that counts.

Before each optimizer step the loop checks the loss and the gradient norm on every rank
(`dsv4rl.train.nonfinite`): a NaN or Inf skips the step (`skip_step`: weights, optimizer state and the
schedule's position untouched; `nonfinite_steps` in the metrics), and more than
`train.max_nonfinite_steps` skips in a row stop the run naming the first non-finite tensor.

Sums are float64 vectors indexed as in `dsv4rl.algo.loss` (LOSS, ENTROPY, ...): the loss terms come from
each micro-batch's forward on the ranks that compute the loss; the batch-derived terms (train-vs-rollout
difference, TIS/MIS counts) from the old-policy pass, or from each training forward when it serves as the
old policy.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor

from dsv4rl.algo.grpo import token_logprobs
from dsv4rl.algo.loss import (
    CLIPPED,
    ENTROPY,
    KL,
    LOSS,
    NUM_STEP_SUMS,
    OldPolicy,
    from_training_forward,
    gradient_scale,
    micro_batch_loss,
    normaliser_share,
    old_policy,
    step_metrics,
)
from dsv4rl.config.schema import Config
from dsv4rl.faults.nonfinite import InjectTarget, NonFiniteError, injected
from dsv4rl.train.batch import TrainBatch
from dsv4rl.train.lr_schedule import LearningRateSchedule
from dsv4rl.train.nonfinite import update_culprit

log = logging.getLogger(__name__)


@dataclass
class MicroBatch:
    """A piece of a mini-batch as a backend runs it: `batch` (trimmed, maybe padded with loss-free rows),
    the step-batch row it starts at, and how many of its rows are real."""

    batch: TrainBatch
    row: int
    real: int


# logits of a micro-batch -> (the loss to backpropagate, its float64 step sums)
MicroLoss = Callable[[Tensor, MicroBatch], tuple[Tensor, Tensor]]


class UpdateBackend(Protocol):
    """What the update loop needs from a trainer backend. Every method is collective over its ranks.

    `step` counts train steps and `updates` optimizer steps taken (the schedule's position; both in
    checkpoints); `nonfinite_in_a_row` the optimizer steps skipped since the last one taken.
    `gradient_average`: the ranks its data-parallel gradient reduction averages over (undone by the loss
    scale; 1 where it sums). `counts_loss_sums` / `counts_batch_sums`: whether this rank's copy of the loss
    terms / of the batch-derived terms enters the step's totals (one copy per data-parallel replica).
    `reuse_policy_forward=False` forces the separate old-policy pass (tests compare both paths).
    """

    cfg: Config
    device: torch.device
    step: int
    updates: int
    nonfinite_in_a_row: int
    reuse_policy_forward: bool
    has_reference: bool
    gradient_average: int
    counts_loss_sums: bool
    counts_batch_sums: bool

    def data_parallel_all_reduce(
        self, tensor: Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
    ) -> None: ...

    def micro_batches(self, mini: TrainBatch, row: int) -> list[MicroBatch]: ...

    def forward_logprobs(
        self, micro: Sequence[MicroBatch], temperature: float, reference: bool = False
    ) -> list[Tensor]: ...

    def forward_backward(self, micro: Sequence[MicroBatch], loss: MicroLoss) -> Tensor: ...

    def grad_norm(self) -> float:
        """The global gradient norm before clipping (NaN or Inf when a gradient is)."""
        ...

    def optimizer_step(self, lr: float) -> None:
        """Clip to `optim.grad_clip` by the norm `grad_norm` just returned, and step at `lr`."""
        ...

    def skip_step(self) -> None:
        """Drop the gradients; the weights and the optimizer state stay as they are."""
        ...

    def local_weights(self) -> Iterator[tuple[str, Tensor]]: ...

    def local_gradients(self) -> Iterator[tuple[str, Tensor]]: ...


def train_step(
    backend: UpdateBackend, batch: TrainBatch, temperature: float | None = None
) -> dict[str, float]:
    """One rollout batch (this rank's share, `TrainBatch.shard`): `algo.updates_per_step` optimizer steps.

    The loss is normalised over the global mini-batch (the normaliser all-reduced over data-parallel
    ranks, gradient averaging undone), so the update depends on neither the world size nor the
    micro-batch size."""
    cfg = backend.cfg
    algo = cfg.algo
    temp = algo.sampling.temperature if temperature is None else temperature
    updates = algo.updates_per_step
    step = backend.step + 1  # the loop's numbering: a resumed backend holds the steps it completed
    if injected(InjectTarget.advantages, step):  # a test hook (dsv4rl.faults.nonfinite)
        advantages = batch.advantages.clone()
        advantages[:1] = float("nan")  # NaN * mask is NaN: one is enough for the loss and gradients
        batch = dataclasses.replace(batch, advantages=advantages)
    batch = batch.to(backend.device)
    _check_shares(backend, batch, updates)
    ref = batch.ref_logprobs
    if backend.has_reference and ref is None:
        ref = masked_logprobs(backend, batch, temp, reference=True)
    policy = old_policy(
        algo,
        batch.old_logprobs,
        batch.rollout_logprobs,
        batch.loss_mask,
        ref is not None,
        lambda: masked_logprobs(backend, batch, temp),
        reuse_allowed=backend.reuse_policy_forward,
    )
    schedule = LearningRateSchedule.from_config(cfg)
    loss_sums = torch.zeros(NUM_STEP_SUMS, dtype=torch.float64, device=backend.device)
    grad_norms, lrs = [], []
    skipped = 0
    row = 0
    for index, mini in enumerate(batch.split(updates)):
        share = normaliser_share(mini.loss_mask, algo.loss_aggregation, algo.sampling.max_new_tokens)
        share = share.to(torch.float64)
        backend.data_parallel_all_reduce(share)
        denom = max(float(share), 1.0)  # no response token anywhere: loss 0, as `aggregate` gives
        loss = micro_batch_objective(cfg, policy, ref, temp, denom, backend.gradient_average)
        sums = backend.forward_backward(backend.micro_batches(mini, row), loss)
        loss_sums += sums
        row += mini.size
        lr = cfg.optim.lr * schedule(backend.updates)
        grad_norms.append(backend.grad_norm())
        lrs.append(lr)
        culprit = update_culprit(backend, sums[LOSS], grad_norms[-1])
        if culprit is None:
            backend.optimizer_step(lr)
            backend.updates += 1
            backend.nonfinite_in_a_row = 0
            continue
        backend.skip_step()
        skipped += 1
        backend.nonfinite_in_a_row += 1
        _skipped(cfg, step, f"{index + 1} of {updates}", culprit, backend.nonfinite_in_a_row)
    if injected(InjectTarget.weights, step):
        _poison_first_weight(backend)
    backend.step += 1
    totals = loss_sums * float(backend.counts_loss_sums) + policy.sums * float(backend.counts_batch_sums)
    dist.all_reduce(totals)
    return {**step_metrics(totals, updates, grad_norms, lrs, ref is not None), "nonfinite_steps": skipped}


def _skipped(cfg: Config, step: int, update: str, culprit: str, in_a_row: int) -> None:
    """Log a skipped optimizer step, or stop the run when too many came in a row."""
    limit = cfg.train.max_nonfinite_steps
    if in_a_row > limit:
        raise NonFiniteError(
            step,
            "train",
            culprit,
            f"{in_a_row} non-finite optimizer step{'s' if in_a_row > 1 else ''} in a row (the last: update "
            f"{update} of this step), more than train.max_nonfinite_steps={limit}. A skipped step changes "
            "nothing: the weights and the optimizer state are those of the last finite step, and no "
            "checkpoint holds non-finite weights. Look at this step's batch (rewards, advantages, "
            "log-probs); a lower optim.lr or an optim.grad_clip may help; resume=true continues from the "
            "newest checkpoint",
        )
    if dist.get_rank() == 0:
        log.warning(
            "step %d, update %s: the first non-finite tensor is %s; optimizer step skipped "
            "(%d in a row, train.max_nonfinite_steps=%d)",
            *(step, update, culprit, in_a_row, limit),
        )


def _poison_first_weight(backend: UpdateBackend) -> None:
    """The `weights` test hook: a NaN in the first floating weight this rank holds (rank 0 only)."""
    if dist.get_rank() != 0:
        return
    with torch.no_grad():
        for _, tensor in backend.local_weights():
            if tensor.is_floating_point() and tensor.numel():
                tensor[(0,) * tensor.dim()] = float("nan")
                return


def micro_batch_objective(
    cfg: Config, policy: OldPolicy, ref: Tensor | None, temperature: float, denom: float, averaged_over: int
) -> MicroLoss:
    """The loss of one micro-batch from its logits, scaled for backward, with its share of the step sums."""
    algo = cfg.algo
    scale = gradient_scale(denom, averaged_over)

    def loss(logits: Tensor, micro: MicroBatch) -> tuple[Tensor, Tensor]:
        part = micro.batch
        rows = slice(micro.row, micro.row + micro.real)
        width = part.loss_mask.shape[1]
        logprobs = token_logprobs(logits, part.input_ids, temperature)
        if policy.reuse:
            old, tis, sums = from_training_forward(
                algo, logprobs, part.rollout_logprobs, part.loss_mask, ref is not None
            )
        else:
            old = padded_rows(policy.logprobs, rows, part.size)[:, :width]
            tis = None if policy.tis_weights is None else padded_rows(policy.tis_weights, rows, part.size)
            tis = None if tis is None else tis[:, :width]
            sums = torch.zeros(NUM_STEP_SUMS, dtype=torch.float64, device=logits.device)
        out = micro_batch_loss(
            logprobs,
            logits,
            old,
            part.advantages,
            part.loss_mask,
            algo,
            temperature,
            ref_logprobs=None if ref is None else padded_rows(ref, rows, part.size)[:, :width],
            tis_weights=tis,
        )
        sums[LOSS] += out.loss_sum.detach() / denom
        sums[ENTROPY] += out.entropy_sum
        sums[CLIPPED] += out.clipped_tokens
        if out.ref_kl_sum is not None:
            sums[KL] += out.ref_kl_sum
        return out.loss_sum * scale, sums

    return loss


def masked_logprobs(
    backend: UpdateBackend, batch: TrainBatch, temperature: float, reference: bool = False
) -> Tensor:
    """Log-probs of the loss-bearing targets (the policy's, or the reference model's), computed on the same
    micro-batches the update uses, so the first update's ratio is exactly 1; zero past each trim."""
    out = torch.zeros_like(batch.loss_mask)
    row = 0
    for mini in batch.split(backend.cfg.algo.updates_per_step):
        micro = backend.micro_batches(mini, row)
        for part, logprobs in zip(
            micro, backend.forward_logprobs(micro, temperature, reference=reference), strict=True
        ):
            out[part.row : part.row + part.real, : logprobs.shape[1]] = logprobs[: part.real]
        row += mini.size
    return out


def padded_rows(tensor: Tensor, rows: slice, size: int) -> Tensor:
    """`size` rows from `rows.start`, zero past the real ones (a micro-batch's loss-free padding rows)."""
    part = tensor[rows]
    if part.shape[0] < size:
        part = torch.cat([part, part.new_zeros(size - part.shape[0], *part.shape[1:])])
    return part


def _check_shares(backend: UpdateBackend, batch: TrainBatch, updates: int) -> None:
    """Every data-parallel replica must hold as many sequences (their collectives pair up micro-batch by
    micro-batch), in whole mini-batches."""
    sizes = torch.tensor([batch.size, -batch.size], device=backend.device)
    backend.data_parallel_all_reduce(sizes, op=dist.ReduceOp.MAX)
    if int(sizes[0]) != -int(sizes[1]):
        raise ValueError(
            f"data-parallel replicas hold different batch sizes ({-int(sizes[1])}..{int(sizes[0])}); "
            "use TrainBatch.shard"
        )
    if batch.size % updates:
        raise ValueError(
            f"{batch.size} sequences per replica do not split into algo.updates_per_step={updates}"
        )
