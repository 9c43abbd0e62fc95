"""How SGLang 0.5.23 reads a model directory: its config path (`get_config`, which re-reads a
`deepseek_v4` config.json as a DeepseekV3Config subclass, and `get_rope_config`) and the engine's
`ModelConfig` (dtype under `--dtype`, quantization, the FP4-expert detection, the attention schedule),
then the quantization config the model loader builds from it. Plain data back."""

from __future__ import annotations


def _quant_config(model_config) -> dict | None:
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    quant = _get_quantization_config(model_config, LoadConfig())
    if quant is None:
        return None
    return {
        "class": type(quant).__name__,
        "weight_block_size": list(getattr(quant, "weight_block_size", None) or []),
        "is_checkpoint_fp8_serialized": getattr(quant, "is_checkpoint_fp8_serialized", None),
    }


def read(paths: list[str], dtype: str = "auto") -> dict[str, dict]:
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.hf_transformers.common import get_rope_config
    from sglang.srt.utils.hf_transformers.config import get_config

    out = {}
    for path in paths:
        config = get_config(path, trust_remote_code=False)
        theta, rope = get_rope_config(config)
        model = ModelConfig.from_server_args(ServerArgs(model_path=path, device="cpu", dtype=dtype))
        hf = model.hf_config
        out[path] = {
            "model_type": config.model_type,
            "architectures": list(config.architectures or []),
            "compress_ratios": list(config.compress_ratios),
            "num_hash_layers": getattr(config, "num_hash_layers", 0),
            "topk_method": getattr(config, "topk_method", None),
            "rope_theta": theta,
            "rope": {
                k: rope.get(k)
                for k in ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
            },
            "compress_rope_theta": config.compress_rope_theta,
            "head_dim": config.head_dim,
            "qk_rope_head_dim": config.qk_rope_head_dim,
            "num_hidden_layers": config.num_hidden_layers,
            "n_routed_experts": config.n_routed_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "sliding_window": config.sliding_window,
            "index_topk": getattr(config, "index_topk", None),
            "hc_mult": getattr(config, "hc_mult", None),
            "vocab_size": config.vocab_size,
            # the engine's view
            "dtype": str(model.dtype).removeprefix("torch."),
            "quantization": model.quantization,
            "is_fp4_experts": getattr(model, "is_fp4_experts", None),
            "window_size": getattr(model, "window_size", None),
            "engine_compress_ratios": list(getattr(model, "compress_ratios", []) or []),
            "n_group": getattr(hf, "n_group", None),
            "topk_group": getattr(hf, "topk_group", None),
            "quant_config": _quant_config(model),
        }
    return out
