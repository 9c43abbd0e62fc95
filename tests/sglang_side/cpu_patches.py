"""Every change SGLang 0.5.23's DeepSeek-V4 model needs to be built and loaded on a CPU, and why.

SGLang serves on GPUs; its model code also imports and builds on a CPU, except where it asks the
accelerator a question at construction or at the end of a load. Each patch below answers that one
question and touches nothing the weight path runs: names, fusions, weight loaders, quantization
methods and `process_weights_after_loading` stay SGLang's own. `install()` is idempotent.
"""

from __future__ import annotations

import functools

PATCHES = {
    "rotary_embedding.base._is_cpu": (
        "the rotary embedding's base class imports a vllm custom op unless it knows it is on a CPU "
        "(sglang/srt/layers/rotary_embedding/base.py:39, :124)"
    ),
    "deepseek_v4.get_rope_wrapper(device=None)": (
        "MQALayer passes the CPU device, and the CPU branch asserts rope_scaling, which sliding-window "
        "layers (ratio 0) have none of (sglang/srt/layers/rotary_embedding/factory.py:478, :527); the "
        "device-agnostic branch builds the same tables on the default device"
    ),
    "rope_variant.get_device -> 'cpu'": (
        "the YaRN rope of compressed layers asks for an accelerator device (rope_variant.py:373), which a "
        "CPU-only process lacks"
    ),
    "DeepseekV4ForCausalLM._prewarm_mhc_kernels -> no-op": (
        "the first load_weights ends with a TileLang/CUDA compile of the mHC kernels and a CUDA "
        "synchronize (deepseek_v4.py:5183-5249); it compiles kernels, it loads no weight"
    ),
}

_installed = False


def install() -> list[str]:
    """Install the patches (once); returns their names, as listed in PATCHES."""
    global _installed
    if _installed:
        return list(PATCHES)
    import sglang.srt.layers.rotary_embedding.base as rope_base
    import sglang.srt.layers.rotary_embedding.rope_variant as rope_variant
    from sglang.srt.models import deepseek_v4

    rope_base._is_cpu = True

    original = deepseek_v4.get_rope_wrapper

    @functools.wraps(original)
    def rope_on_default_device(*args, device=None, **kwargs):
        return original(*args, device=None, **kwargs)

    deepseek_v4.get_rope_wrapper = rope_on_default_device
    rope_variant.get_device = lambda device_id=None: "cpu"
    deepseek_v4.DeepseekV4ForCausalLM._prewarm_mhc_kernels = lambda self: None
    _installed = True
    return list(PATCHES)
