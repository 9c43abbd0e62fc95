"""SGLang 0.5.23's own command-line parser on the launch commands dsv4rl plans: `prepare_server_args`,
what `python -m sglang.launch_server` runs on its argv (argument groups, the config file, the
model-specific hooks of `ServerArgs.__post_init__`). Returns the resolved values dsv4rl means to set."""

from __future__ import annotations

FIELDS = (
    "model_path", "host", "port", "tp_size", "ep_size", "dp_size", "attn_dp_size", "base_gpu_id",
    "random_seed", "watchdog_timeout", "dtype", "moe_runner_backend", "mem_fraction_static",
    "max_running_requests", "api_key", "admin_api_key", "enable_return_routed_experts",
    "enable_return_indexer_topk", "enable_fp32_lm_head", "enable_memory_saver",
    "enable_deterministic_inference", "kv_cache_dtype", "disable_radix_cache",
    "enable_decoder_swa_bounded_replay",
)  # fmt: skip


def parse(commands: list[dict]) -> list[dict]:
    """`prepare_server_args(argv)` for each command {argv: the arguments after `-m sglang.launch_server`,
    env: the SGLANG_* variables the planner gives that engine, set while it is parsed}."""
    import os

    from sglang.srt.server_args import prepare_server_args

    out = []
    for command in commands:
        saved = {name: os.environ.get(name) for name in command["env"]}
        os.environ.update(command["env"])
        try:
            args = prepare_server_args(list(command["argv"]))
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value
        out.append({name: getattr(args, name, "<missing>") for name in FIELDS})
    return out
