"""`python -m dsv4rl.engine --model-path DIR [--port P] ...`: the CPU reference engine (SGLang flag names)."""

from __future__ import annotations

import argparse
from typing import Any


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsv4rl.engine",
        description="CPU reference engine speaking the SGLang 0.5.23 HTTP protocol subset.",
    )
    parser.add_argument(
        "--model-path", "--model", dest="model_path", required=True, help="transformers model dir"
    )
    parser.add_argument("--tokenizer-path", default=None, help="default: the model path")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--max-batch-size", "--max-running-requests", dest="max_batch_size", type=int, default=256
    )
    parser.add_argument("--random-seed", type=int, default=None, help="default: a random int")
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--admin-api-key", default=None)
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"]
    )
    parser.add_argument(
        "--num-threads", type=int, default=None, help="torch intra-op threads (default: torch's)"
    )
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--skip-tokenizer-init", action="store_true")
    parser.add_argument("--skip-server-warmup", action="store_true")
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "float", "bfloat16", "float16", "half"]
    )
    parser.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument(
        "--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1, choices=[1]
    )
    return parser


def parse_args(argv: list[str] | None = None) -> dict[str, Any]:
    """Flags as ServerArgs keyword arguments (plus model_path and log_level)."""
    args = vars(build_parser().parse_args(argv))
    args["dtype"] = {"float": "float32", "half": "float16"}.get(args["dtype"], args["dtype"])
    return args


if __name__ == "__main__":
    from dsv4rl.engine.server import main

    main()
