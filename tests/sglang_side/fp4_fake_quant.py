"""DeepSeek-V4.1's FP4 fake quantization as SGLang 0.5.23 computes it (`sglang/kernels/ops/quantization/
fp4_fake_quant.py`: `fake_quant_fp4` for the indexer's queries and keys, `fake_quant_compressed_kv` for the
compressed KV), on tensors from a safetensors file; the results go to another."""

from __future__ import annotations


def apply(inputs: str, out: str) -> list[str]:
    """For each tensor `name` in `inputs`: `name.index` and `name.kv`, SGLang's two results, into `out`."""
    from safetensors.torch import load_file, save_file
    from sglang.kernels.ops.quantization.fp4_fake_quant import fake_quant_compressed_kv, fake_quant_fp4

    results = {}
    for name, tensor in load_file(inputs).items():
        results[f"{name}.index"] = fake_quant_fp4(tensor).contiguous()
        results[f"{name}.kv"] = fake_quant_compressed_kv(tensor).contiguous()
    save_file(results, out)
    return sorted(results)
