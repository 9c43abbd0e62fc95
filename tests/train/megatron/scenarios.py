"""Run under torchrun (gloo, CPU): the Megatron DeepSeek-V4 model at a parallel layout, against the
same weights in transformers. Writes OUT (torch.save) on rank 0 for tests/train/megatron to compare.

Usage: scenarios.py OUT CONFIG TP PP EP [LAST_STAGE_LAYERS]     CONFIG: tiny | every_type
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

from dsv4rl.config.schema import TinyModelConfig
from dsv4rl.model.tiny import tiny_hf_config
from dsv4rl.train.megatron import convert
from dsv4rl.train.megatron.architecture import ParallelSizes
from dsv4rl.train.megatron.parallel import build_stage, initialize, run_pipeline

VOCAB = 64
EVERY_TYPE = TinyModelConfig(
    num_hidden_layers=6,
    layer_types=["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"] * 2,
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"],
    hca_compress_rate=8,
    index_topk=4,
)


def hf_config(name: str) -> DeepseekV4Config:
    return tiny_hf_config(TinyModelConfig() if name == "tiny" else EVERY_TYPE, VOCAB)


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


def batch(config: DeepseekV4Config) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(2)
    ids = torch.randint(3, config.vocab_size, (4, 48), generator=generator)
    weights = torch.randn(4, 47, generator=generator)
    return ids, weights


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def main() -> None:
    out, name = sys.argv[1], sys.argv[2]
    last = int(sys.argv[6]) if len(sys.argv) > 6 else None
    sizes = ParallelSizes(
        tensor=int(sys.argv[3]), pipeline=int(sys.argv[4]), expert=int(sys.argv[5]), last_stage_layers=last
    )
    dist.init_process_group("gloo")
    initialize(sizes)
    config = hf_config(name)
    reference = reference_model(config)
    ids, weights = batch(config)

    model = build_stage(config, sizes, torch.float32)
    model.eval()  # no dropout; megatron's MoE also refuses TP without sequence parallel in training mode
    offset = model.decoder.offset
    ranks = convert.Ranks.current(offset)
    convert.load_hf_state(model, reference.state_dict(), ranks, config.n_routed_experts)

    # data parallel: each DP rank takes its share of the 2-sequence micro-batches
    dp_rank, dp_size = parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size()
    micro = [{"input_ids": ids[i : i + 2], "weights": weights[i : i + 2]} for i in range(0, 4, 2)]
    mine = micro[dp_rank::dp_size]

    def loss_function(logits: torch.Tensor, data: dict[str, torch.Tensor]):
        logprobs = token_logprobs(logits, data["input_ids"])
        loss = (logprobs * data["weights"]).sum()
        return loss, torch.tensor(1), {"logprobs": logprobs.detach(), "loss": loss.detach()}

    reported = run_pipeline(model, mine, loss_function, forward_only=False)

    # gradients: sum the data-parallel shares (dense over the DP group, experts over expert-DP)
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
    parameters = {name for name, _ in reference.named_parameters()}  # not the buffers (tid2eid, bias)
    stage_grads = {
        name: grad
        for name, grad in convert.gather_stage(model, ranks, config.n_routed_experts, values)
        if name in parameters
    }
    stage_weights = dict(convert.gather_stage(model, ranks, config.n_routed_experts))

    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (dp_rank, reported, stage_grads, stage_weights))
    if dist.get_rank() == 0:
        by_micro = {}
        grads_all, weights_all = {}, {}
        for dp, items, stage_g, stage_w in gathered:
            for k, item in enumerate(items):
                by_micro[dp + k * dp_size] = item
            grads_all.update(stage_g)
            weights_all.update(stage_w)
        logprobs = torch.cat([by_micro[i]["logprobs"] for i in sorted(by_micro)])
        loss = sum(float(by_micro[i]["loss"]) for i in by_micro)
        reference.zero_grad()
        ref_logits = reference(input_ids=ids, use_cache=False).logits
        ref_logprobs = token_logprobs(ref_logits, ids)
        (ref_logprobs * weights).sum().backward()
        ref_grads = {
            n: (p.grad if p.grad is not None else torch.zeros_like(p))
            for n, p in reference.named_parameters()
        }
        torch.save(
            {
                "logprobs": logprobs,
                "loss": loss,
                "grads": grads_all,
                "weights": weights_all,
                "reference_logprobs": ref_logprobs.detach(),
                "reference_loss": float((ref_logprobs * weights).sum()),
                "reference_grads": ref_grads,
                "reference_state": {k: v.clone() for k, v in reference.state_dict().items()},
            },
            out,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
