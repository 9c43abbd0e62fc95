"""Both trainer backends (fsdp, megatron; world size 1, gloo on CPU) on a batch whose responses interleave
sampled targets (loss mask 1) with inserted ones (tool results, turn tokens: mask 0), one `train_step`:

- the logits rows of mask-0 targets get exactly zero gradient, and the logits' and the parameters'
  gradients are those of the loss written over the mask-1 targets alone (tests/algo/test_masked_loss.py's
  `handwritten_loss`; the inserted tokens stay in the input, conditioning later tokens);
- the gradients and every metric are bit for bit the same when the rollout, old and reference log-probs
  at mask-0 targets are garbage (non-finite rollout values included);
- `response_tokens` is the number of mask-1 targets, and the metrics are means over those alone.

Each backend runs as this file's own script in a subprocess (a process group and megatron's global
state of its own), both at once; the script captures the gradients where the optimizer step would
use them and does not step, so every case sees the same weights.
Usage: test_masked_loss_backends.py OUT_DIR fsdp|megatron
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "algo"))  # the hand-written loss
from test_masked_loss import handwritten_loss  # noqa: E402

from dsv4rl.config.choices import TrainBackend
from dsv4rl.config.schema import Config
from dsv4rl.train.batch import TrainBatch  # noqa: E402

TIMEOUT_S = 300
# megatron-core's import and model build take ~30 s on CPU: its cases are slow (the fsdp ones ~10 s)
KINDS = [pytest.param("fsdp"), pytest.param("megatron", marks=pytest.mark.slow)]
TEMPERATURE = 0.9
# per row: prompt length, then alternating spans of sampled (mask 1) and inserted (mask 0) targets
LAYOUT = ((3, [4, 3, 5, 4, 2]), (2, [6, 5, 3]), (4, [2, 2, 3, 6, 4, 1, 2]), (3, [5, 7]))
ADVANTAGES = [1.0, -0.8, 0.5, -1.3]


# ---------------------------------------------------------------------------------------- the scenario
def config(backend: str) -> Config:
    cfg = Config()
    cfg.train.micro_batch_size = 2  # two micro-batches: the normaliser spans them
    cfg.optim.lr = 1e-3
    algo = cfg.algo
    algo.kl_coef, algo.entropy_coef = 0.1, 0.02
    algo.tis.enabled, algo.tis.clip = True, 1.2
    algo.mis.enabled, algo.mis.low, algo.mis.high = True, 0.7, 1.5
    if backend == "megatron":
        cfg.parallel.train.backend = TrainBackend.megatron
    return cfg


def make_batch(policy_logprobs: torch.Tensor, ids: torch.Tensor, mask: torch.Tensor, old_given: bool):
    """The engine's log-probs near the policy's on mask-1 targets (TIS clips and MIS drops some), 0.0 on
    the inserted ones; with `old_given` old and reference log-probs the batch carries (PPO clips)."""
    g = torch.Generator().manual_seed(5)
    noise = 0.35 * torch.randn(mask.shape, generator=g)
    batch = TrainBatch(ids, mask, torch.tensor(ADVANTAGES), (policy_logprobs + noise) * mask)
    if old_given:
        batch.old_logprobs = policy_logprobs + 0.3 * torch.randn(mask.shape, generator=g)
        batch.ref_logprobs = policy_logprobs - 0.2 * torch.rand(mask.shape, generator=g)
    return batch


def scrambled(batch: TrainBatch) -> TrainBatch:
    """`batch` with garbage at every mask-0 target of each per-token log-prob it carries; the rollout's
    include -inf, +inf and NaN."""
    g = torch.Generator().manual_seed(11)
    off = batch.loss_mask == 0
    out = TrainBatch(batch.input_ids, batch.loss_mask, batch.advantages, batch.rollout_logprobs)
    for name in ("rollout_logprobs", "old_logprobs", "ref_logprobs"):
        value = getattr(batch, name)
        if value is not None:
            garbage = torch.empty_like(value).uniform_(-60.0, 8.0, generator=g)
            setattr(out, name, torch.where(off, garbage, value))
    rollout = out.rollout_logprobs.clone()
    inserted = [(b, t) for b, t in off.nonzero().tolist() if t > int(batch.loss_mask[b].nonzero()[0])]
    for (b, t), value in zip(inserted[:3], (-math.inf, math.inf, math.nan), strict=True):
        rollout[b, t] = value
    out.rollout_logprobs = rollout
    return out


def captured_step(backend, batch: TrainBatch) -> dict:  # noqa: ANN001
    """One `train_step`: the logits each micro-batch's loss saw and their gradients, the parameters'
    gradients where the optimizer step would read them (no step is taken), and the metrics."""
    logits_seen, logits_grads, grads = [], [], {}
    original = type(backend).forward_backward

    def forward_backward(micro, loss):  # noqa: ANN001, ANN202
        def hooked(logits, part):  # noqa: ANN001, ANN202
            logits_seen.append((logits.detach().clone(), part.row, part.real))
            logits.register_hook(lambda grad: logits_grads.append(grad.detach().clone()))
            return loss(logits, part)

        return original(backend, micro, hooked)

    def optimizer_step(lr: float) -> None:
        grads.update({name: grad.detach().clone() for name, grad in backend.local_gradients()})

    backend.forward_backward, backend.optimizer_step = forward_backward, optimizer_step
    try:
        metrics = backend.train_step(batch, temperature=TEMPERATURE)
    finally:
        del backend.forward_backward, backend.optimizer_step
    return {"logits": logits_seen, "logits_grads": logits_grads, "grads": grads, "metrics": metrics}


def reference_gradients(backend, batch: TrainBatch, cfg: Config, kind: str) -> tuple[dict, dict]:  # noqa: ANN001
    """The parameters' gradients of `handwritten_loss` on the trainable model's own forward (each
    micro-batch's rows, untrimmed: the trailing columns carry no loss), and the metrics as means over the
    mask-1 targets."""
    model = backend.model
    params = {name: p for name, p in model.named_parameters() if p.requires_grad}
    count = float(batch.loss_mask.sum())
    ref = batch.ref_logprobs
    if ref is None:  # the reference model's log-probs (the same weights: KL 0, gradient still live)
        ref = backend.compute_logprobs(batch.input_ids, TEMPERATURE)
    total = None
    stats = {"entropy": 0.0, "abs_diff": 0.0, "kl": 0.0}
    size = cfg.train.micro_batch_size
    for start in range(0, batch.size, size):
        rows = slice(start, start + size)
        ids = batch.input_ids[rows]
        logits = model(input_ids=ids, use_cache=False).logits if kind == "fsdp" else model(ids)
        mask = batch.loss_mask[rows]
        old = None if batch.old_logprobs is None else batch.old_logprobs[rows]
        loss = handwritten_loss(
            logits, ids, mask, batch.advantages[rows], batch.rollout_logprobs[rows], old, ref[rows],
            cfg.algo, TEMPERATURE, count,
        )  # fmt: skip
        total = loss if total is None else total + loss
        with torch.no_grad():
            on = mask > 0
            log_p = torch.log_softmax(logits[:, :-1].double() / TEMPERATURE, -1)
            logp = log_p.gather(-1, ids[:, 1:, None])[..., 0]
            stats["entropy"] += float(-(log_p.exp() * log_p).sum(-1)[on].sum())
            o = logp if old is None else old.double()
            stats["abs_diff"] += float((o - batch.rollout_logprobs[rows].double())[on].abs().sum())
            d = ref[rows].double() - logp
            stats["kl"] += float((d.exp() - d - 1.0)[on].sum())
    grads = torch.autograd.grad(total, list(params.values()), allow_unused=True)
    out = {name: g for name, g in zip(params, grads, strict=True) if g is not None}
    return out, {key: value / count for key, value in stats.items()}


def scenario(out_dir: Path, kind: str) -> None:
    import torch.distributed as dist

    from dsv4rl.model.model_dir import materialize_model
    from dsv4rl.train.backend import build_backend

    store = dist.FileStore(str(out_dir / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    path = materialize_model(Config().model, str(out_dir / "model"))
    ids, mask = layout_batch()
    results: dict = {"mask": mask, "ids": ids}
    cfg = config(kind)
    backend = build_backend(cfg, path, None)
    for old_given in (False, True):
        policy = backend.compute_logprobs(ids, TEMPERATURE).cpu()
        batch = make_batch(policy, ids, mask, old_given)
        case = {
            "clean": captured_step(backend, batch),
            "scrambled": captured_step(backend, scrambled(batch)),
        }
        grads, stats = reference_gradients(backend, batch, cfg, kind)
        case["reference_grads"], case["reference_stats"] = grads, stats
        ref = (
            batch.ref_logprobs
            if batch.ref_logprobs is not None
            else backend.compute_logprobs(ids, TEMPERATURE)
        )
        case["batch"] = {
            "ids": ids,
            "advantages": batch.advantages,
            "rollout": batch.rollout_logprobs,
            "old": batch.old_logprobs,
            "ref": ref.cpu(),
        }
        results["old_given" if old_given else "old_from_training_forward"] = case
    torch.save(results, out_dir / "results.pt")
    dist.destroy_process_group()


def layout_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [4, T] and loss_mask [4, T-1] of LAYOUT, right-padded; the last row ends in inserted
    tokens (a tool result after the last sampled turn: trimmed away, it carries nothing)."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for prompt, spans in LAYOUT:
        row = [0.0] * (prompt - 1)
        for index, n in enumerate(spans):
            row += [1.0 if index % 2 == 0 else 0.0] * n
        rows.append(row)
    width = max(map(len, rows)) + 1
    mask = torch.tensor([r + [0.0] * (width - len(r)) for r in rows])
    ids = torch.randint(4, 27, (len(rows), width + 1), generator=g)
    return ids, mask


# ---------------------------------------------------------------------------------------- the tests
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """The scenarios of the backends the selected tests need, concurrently."""
    selected = request.session.items
    kinds = {
        i.callspec.params["kind"] for i in selected if i.module is request.module and hasattr(i, "callspec")
    }
    root = tmp_path_factory.mktemp("masked_loss")
    env = dict(os.environ, OMP_NUM_THREADS="2", MASTER_ADDR="127.0.0.1")
    procs = {}
    for kind in sorted(kinds):
        out = root / kind
        out.mkdir()
        env["MASTER_PORT"] = str(_free_port())
        cmd = [sys.executable, str(Path(__file__)), str(out), kind]
        procs[kind] = (
            subprocess.Popen(
                cmd, env=dict(env), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                start_new_session=True,
            ),
            out,
        )  # fmt: skip
    results = {}
    try:
        for kind, (proc, out) in procs.items():
            try:
                log, _ = proc.communicate(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"the {kind} scenario exceeded {TIMEOUT_S}s")
            assert proc.returncode == 0, f"the {kind} scenario failed:\n{log[-6000:]}"
            results[kind] = torch.load(out / "results.pt", weights_only=False)
    finally:
        for proc, _ in procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


CASES = ("old_from_training_forward", "old_given")


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_mask0_logits_rows_get_exactly_zero_gradient(runs, kind, case):
    r = runs[kind]
    step = r[case]["clean"]
    assert len(step["logits"]) == len(step["logits_grads"]) == 2  # two micro-batches
    live = 0
    for (logits, row, real), grad in zip(step["logits"], step["logits_grads"], strict=True):
        assert grad.shape == logits.shape
        width = logits.shape[1] - 1  # the micro-batch's trimmed target columns
        mask = r["mask"][row : row + real, :width]
        off = torch.cat([mask == 0, torch.ones(real, 1, dtype=torch.bool)], dim=1)
        assert grad[:real][off].abs().max() == 0.0, (kind, case, row)
        assert grad[:real][~off].abs().amax(dim=-1).min() > 0
        live += int((~off).sum())
    assert live == int(r["mask"].sum())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_gradients_are_those_of_the_loss_over_mask1_targets_alone(runs, kind, case):
    """The logits' gradient against `handwritten_loss` on the logits the backend computed, and the
    parameters' gradient against it on the model's own forward (float32 model, float64 loss)."""
    r = runs[kind]
    step, mask = r[case]["clean"], r["mask"]
    cfg = config(kind)
    count = float(mask.sum())
    batch = r[case]["batch"]
    for (logits, row, real), grad in zip(step["logits"], step["logits_grads"], strict=True):
        rows = slice(row, row + real)
        leaf = logits[:real].clone().requires_grad_(True)
        width = logits.shape[1]
        old = None if batch["old"] is None else batch["old"][rows, : width - 1]
        want = handwritten_loss(
            leaf, batch["ids"][rows, :width], mask[rows, : width - 1], batch["advantages"][rows],
            batch["rollout"][rows, : width - 1], old, batch["ref"][rows, : width - 1], cfg.algo,
            TEMPERATURE, count,
        )  # fmt: skip
        (want_grad,) = torch.autograd.grad(want, leaf)
        torch.testing.assert_close(grad[:real].double(), want_grad.double(), rtol=1e-4, atol=1e-9)
    got, want = step["grads"], r[case]["reference_grads"]
    assert set(want) <= set(got) and len(want) > 10
    scale = max(float(g.abs().max()) for g in want.values())
    for name, value in want.items():
        torch.testing.assert_close(got[name].double(), value.double(), rtol=1e-3, atol=1e-5 * scale, msg=name)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_logprobs_at_mask0_targets_change_neither_gradients_nor_metrics(runs, kind, case):
    clean, garbage = runs[kind][case]["clean"], runs[kind][case]["scrambled"]
    assert clean["grads"].keys() == garbage["grads"].keys() and len(clean["grads"]) > 10
    for name, grad in clean["grads"].items():
        assert torch.equal(grad, garbage["grads"][name]), name
    assert garbage["metrics"] == clean["metrics"]
    assert max(float(g.abs().max()) for g in clean["grads"].values()) > 0


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("kind", KINDS)
def test_metrics_are_means_over_mask1_targets(runs, kind, case):
    r = runs[kind]
    metrics, stats = r[case]["clean"]["metrics"], r[case]["reference_stats"]
    mask = r["mask"]
    assert metrics["response_tokens"] == float(mask.sum())
    assert metrics["entropy"] == pytest.approx(stats["entropy"], rel=1e-4)
    assert metrics["logprob_abs_diff"] == pytest.approx(stats["abs_diff"], rel=1e-4)
    if case == "old_given":  # KL to the given reference (without one: the old policy against the rollout)
        assert metrics["kl"] == pytest.approx(stats["kl"], rel=1e-4)
        assert 0.0 < metrics["clipfrac"] < 1.0
    for key in ("tis_clip_fraction", "mis_masked_fraction"):
        assert 0.0 < metrics[key] < 1.0, key
        # a fraction of mask-1 targets: a whole number of them
        count = metrics[key] * metrics["response_tokens"]
        assert count == pytest.approx(round(count), abs=1e-6), key


if __name__ == "__main__":
    scenario(Path(sys.argv[1]), sys.argv[2])
