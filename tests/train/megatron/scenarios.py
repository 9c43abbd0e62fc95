"""Run under torchrun (gloo, CPU): the Megatron DeepSeek-V4 model at a parallel layout, against the
same weights in transformers. Writes OUT (torch.save) on rank 0 for tests/train/megatron to compare.

Usage: scenarios.py OUT CONFIG TP PP EP [LAST_STAGE_LAYERS] [--dtype float32|bfloat16]
       [--attention sparse|dense] [--query-chunk N]
CONFIG: tiny | every_type | selecting

In bfloat16 the Megatron model runs forward only, and transformers' model is loaded the way
`from_pretrained(dtype=torch.bfloat16)` loads it (its `_keep_in_fp32_modules_strict` stay float32).
"""

from __future__ import annotations

import argparse
import tempfile
from collections import defaultdict

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4IndexerScorer

from dsv4rl.config.choices import AttentionImpl
from dsv4rl.config.model_schema import TinyModelConfig
from dsv4rl.model.tiny import tiny_hf_config
from dsv4rl.train.megatron import convert
from dsv4rl.train.megatron.architecture import ParallelSizes
from dsv4rl.train.megatron.compressor import Compressor, Indexer
from dsv4rl.train.megatron.parallel import build_stage, initialize, run_pipeline

VOCAB = 64
PAD = 2  # tiny_hf_config's pad_token_id
EVERY_TYPE = TinyModelConfig(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    hca_compress_rate=8,
    index_topk=4,
)
# The paths the short configs skip: sequences of 20 sliding windows (window 8), the CSA indexer keeping
# 8 of up to 40 entries (ratio 4), HCA at ratio 16 (10 entries), right-padded rows of odd lengths.
# 8 indexer heads, not 2: with 2, a fifth of the scores are ReLU's exact zeros, and which tied entries
# top-k keeps then depends on the row's length (a padded row would not equal itself unpadded).
SELECTING = TinyModelConfig(hca_compress_rate=16, index_topk=8, index_n_heads=8)
CONFIGS = {"tiny": TinyModelConfig(), "every_type": EVERY_TYPE, "selecting": SELECTING}
SEQUENCE = {"tiny": 48, "every_type": 48, "selecting": 160}
LENGTHS = {"selecting": (160, 160, 131, 97)}  # the real tokens of each row; the rest is padding


def hf_config(name: str) -> DeepseekV4Config:
    return tiny_hf_config(CONFIGS[name], VOCAB)


def reference_model(config: DeepseekV4Config) -> DeepseekV4ForCausalLM:
    """Seeded weights with every tensor away from its init value (zeros and ones hide mapping bugs)."""
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(config)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, parameter in model.named_parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
        for layer in model.model.layers:
            gate = layer.mlp.gate
            if hasattr(gate, "tid2eid"):
                picks = torch.rand(config.vocab_size, config.n_routed_experts, generator=generator)
                gate.tid2eid.copy_(picks.topk(config.num_experts_per_tok, dim=-1).indices)
            else:
                gate.e_score_correction_bias.copy_(
                    torch.randn(config.n_routed_experts, generator=generator) * 0.1
                )
    return model.eval()


def reference_in_bf16(model: DeepseekV4ForCausalLM) -> DeepseekV4ForCausalLM:
    """transformers' bf16 model of these weights, as `from_pretrained(dtype=torch.bfloat16)` builds it."""
    with tempfile.TemporaryDirectory() as directory:
        model.save_pretrained(directory)
        loaded = DeepseekV4ForCausalLM.from_pretrained(
            directory, dtype=torch.bfloat16, attn_implementation="eager"
        )
    return loaded.eval()


def lengths(name: str) -> tuple[int, ...]:
    return LENGTHS.get(name, (SEQUENCE[name],) * 4)


def batch(name: str, config: DeepseekV4Config) -> tuple[torch.Tensor, torch.Tensor]:
    """4 rows; rows shorter than the sequence are right-padded, their padding weighted 0."""
    generator = torch.Generator().manual_seed(2)
    seq = SEQUENCE[name]
    ids = torch.randint(3, config.vocab_size, (4, seq), generator=generator)
    weights = torch.randn(4, seq - 1, generator=generator)
    for row, length in enumerate(lengths(name)):
        ids[row, length:] = PAD
        weights[row, length - 1 :] = 0.0
    return ids, weights


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def record_compression(model: torch.nn.Module) -> dict[str, dict[str, int]]:
    """Hooks that note, per compressor and indexer of this stage, the entries it produced and
    (indexer) the most entries one query kept; filled as the model runs. The indexer's `select` is
    wrapped (both attention forms call it)."""
    seen: dict[str, dict[str, int]] = defaultdict(dict)

    def note_entries(name: str, module: torch.nn.Module, entries: int) -> None:
        record = seen[name]
        record.update(kind="indexer" if isinstance(module, Indexer) else "compressor", ratio=module.ratio)
        record["entries"] = max(record.get("entries", 0), entries)

    def wrap_select(name: str, module: Indexer) -> None:
        select = module.select

        def recorded(hidden: torch.Tensor, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
            selection = select(hidden, *args, **kwargs)
            note_entries(name, module, hidden.shape[1] // module.ratio)
            kept = int(selection.valid.sum(dim=-1).max()) if selection.valid.numel() else 0
            seen[name].update(topk=module.topk, selected=max(seen[name].get("selected", 0), kept))
            return selection

        module.select = recorded

    offset = model.decoder.offset
    for name, module in model.named_modules():
        if isinstance(module, (Compressor, Indexer)):
            parts = name.split(".")
            parts[2] = str(offset + int(parts[2]))  # decoder.layers.<local> -> the global layer
            global_name = ".".join(parts)
            if isinstance(module, Indexer):
                wrap_select(global_name, module)
            else:
                module.register_forward_hook(
                    lambda m, _, out, n=global_name: note_entries(n, m, out.shape[1])
                )
    return seen


def top_k_margins(model: DeepseekV4ForCausalLM) -> list[float]:
    """Hooks on transformers' indexer scorers: for each forward, the smallest gap between the k-th and
    the (k+1)-th visible score over the queries that must choose (filled as the model runs)."""
    margins: list[float] = []
    config = model.config
    ratio, topk = config.compress_rates["compressed_sparse_attention"], config.index_topk

    def note(_module: torch.nn.Module, _inputs: tuple, scores: torch.Tensor) -> None:
        seq, entries = scores.shape[1:]
        visible = torch.arange(entries).view(1, -1) < ((torch.arange(seq) + 1) // ratio).view(-1, 1)
        choosing = visible.sum(-1) > topk
        if entries > topk and choosing.any():
            ranked = scores.masked_fill(~visible, float("-inf")).topk(topk + 1, dim=-1).values
            margins.append(float((ranked[..., topk - 1] - ranked[..., topk])[:, choosing].min()))

    for module in model.modules():
        if isinstance(module, DeepseekV4IndexerScorer):
            module.register_forward_hook(note)
    return margins


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("config", choices=sorted(CONFIGS))
    parser.add_argument("sizes", type=int, nargs=3, metavar=("TP", "PP", "EP"))
    parser.add_argument("last", type=int, nargs="?")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--attention", choices=("sparse", "dense"), default="sparse")
    parser.add_argument("--query-chunk", type=int, default=256)
    args = parser.parse_args()
    tensor, pipeline, expert = args.sizes
    sizes = ParallelSizes(
        tensor=tensor,
        pipeline=pipeline,
        expert=expert,
        last_stage_layers=args.last,
        attention=AttentionImpl(args.attention),
        attention_query_chunk=args.query_chunk,
    )
    dtype = getattr(torch, args.dtype)
    training = dtype == torch.float32
    dist.init_process_group("gloo")
    initialize(sizes)
    config = hf_config(args.config)
    reference = reference_model(config)
    ids, weights = batch(args.config, config)

    model = build_stage(config, sizes, dtype)
    model.eval()  # no dropout; megatron's MoE also refuses TP without sequence parallel in training mode
    offset = model.decoder.offset
    ranks = convert.Ranks.current(offset)
    convert.load_hf_state(model, reference.state_dict(), ranks, config.n_routed_experts)
    compression = record_compression(model)

    # data parallel: each DP rank takes its share of the 2-sequence micro-batches
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    micro = [{"input_ids": ids[i : i + 2], "weights": weights[i : i + 2]} for i in range(0, 4, 2)]
    mine = micro[dp_rank::dp_size]

    def loss_function(logits: torch.Tensor, data: dict[str, torch.Tensor]):
        logprobs = token_logprobs(logits, data["input_ids"])
        loss = (logprobs * data["weights"]).sum()
        return loss, torch.tensor(1), {"logprobs": logprobs.detach(), "loss": loss.detach()}

    reported = run_pipeline(model, mine, loss_function, forward_only=not training)

    stage_grads: dict[str, torch.Tensor] = {}
    if training:
        stage_grads = gather_gradients(
            model, ranks, config, {name for name, _ in reference.named_parameters()}
        )
    stage_weights = dict(convert.gather_stage(model, ranks, config.n_routed_experts))

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, reported, stage_grads, stage_weights, dict(compression)))
    if dist.get_rank() == 0:
        by_micro = {}
        grads_all, weights_all, compression_all = {}, {}, {}
        for dp, items, stage_g, stage_w, stage_c in gathered:
            for k, item in enumerate(items):
                by_micro[dp + k * dp_size] = item
            grads_all.update(stage_g)
            weights_all.update(stage_w)
            for name, record in stage_c.items():  # DP ranks saw different micro-batches: the most of each
                merged = compression_all.setdefault(name, dict(record))
                merged.update({k: max(v, merged[k]) for k, v in record.items() if isinstance(v, int)})
        logprobs = torch.cat([by_micro[i]["logprobs"] for i in sorted(by_micro)])
        loss = sum(float(by_micro[i]["loss"]) for i in by_micro)
        result = {
            "logprobs": logprobs,
            "loss": loss,
            "weights": weights_all,
            "compression": compression_all,
            "lengths": lengths(args.config),
            "reference_state": {k: v.clone() for k, v in reference.state_dict().items()},
        }
        if training:
            result["grads"] = grads_all
        result.update(reference_results(reference, ids, weights, training))
        torch.save(result, args.out)
    dist.barrier()
    dist.destroy_process_group()


def reference_results(
    reference: DeepseekV4ForCausalLM, ids: torch.Tensor, weights: torch.Tensor, training: bool
) -> dict:
    """transformers on the same batch: log-probs, loss, gradients (float32) or the bf16 model's
    log-probs (bfloat16), each right-padded row alone unpadded, the indexers' top-k margins."""
    reference.zero_grad()
    margins = top_k_margins(reference)
    with torch.set_grad_enabled(training):
        logprobs = token_logprobs(reference(input_ids=ids, use_cache=False).logits, ids)
        if training:
            (logprobs * weights).sum().backward()
    result = {
        "top_k_margin": min(margins, default=None),
        "reference_logprobs": logprobs.detach(),
        "reference_loss": float((logprobs * weights).sum()),
    }
    real = (ids != PAD).sum(dim=1).tolist()  # the rows' lengths: the random tokens are never PAD
    with torch.no_grad():
        # each right-padded row alone, unpadded: what its real tokens' log-probs must be
        result["reference_unpadded"] = {
            row: token_logprobs(
                reference(input_ids=ids[row : row + 1, :n], use_cache=False).logits, ids[row : row + 1, :n]
            )[0]
            for row, n in enumerate(real)
            if n < ids.shape[1]
        }
    if training:
        result["reference_grads"] = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in reference.named_parameters()
        }
        return result
    in_bf16 = reference_in_bf16(reference)
    with torch.no_grad():
        result["reference_bf16_logprobs"] = token_logprobs(
            in_bf16(input_ids=ids, use_cache=False).logits, ids
        )
        # float32 arithmetic on the bf16 model's weights: what is left is the computation's rounding
        same_weights = in_bf16.float()(input_ids=ids, use_cache=False).logits
        result["reference_bf16_weights_logprobs"] = token_logprobs(same_weights, ids)
    return result


def gather_gradients(
    model: torch.nn.Module, ranks: convert.Ranks, config: DeepseekV4Config, parameters: set[str]
) -> dict[str, torch.Tensor]:
    """This stage's gradients under transformers' names, summed over the data-parallel shares (dense
    over the DP group, experts over expert-DP) and gathered over TP/EP."""
    grads = {}
    for pname, parameter in model.named_parameters():
        grad = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
        expert = ".local_experts." in pname
        group = (
            parallel_state.get_expert_data_parallel_group()
            if expert
            else parallel_state.get_data_parallel_group()
        )
        dist.all_reduce(grad, group=group)
        if getattr(parameter, "sequence_parallel", False):  # computed on this TP rank's tokens only
            dist.all_reduce(grad, group=parallel_state.get_tensor_model_parallel_group())
        grads[pname] = grad
    values = {n: grads.get(n, t) for n, t in convert.local_tensors(model)}
    return {
        name: grad
        for name, grad in convert.gather_stage(model, ranks, config.n_routed_experts, values)
        if name in parameters  # not the buffers (tid2eid, bias)
    }


if __name__ == "__main__":
    main()
