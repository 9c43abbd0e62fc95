"""How long each grader takes on one long response: `python bench/grader_speed.py [--sizes 16000 100000]`.

A collapsing policy writes responses of tens of thousands of characters; grading one must never stall a
step. Each (grader, shape, size) is timed in a subprocess of its own (a fresh grader, its pool started
and warmed before the clock starts), so a slow case costs at most `--limit` seconds: the row then says
"> limit". A row's time is `grade` (the reward) plus `final_answer` (what maj@n votes on), as eval asks
for both; by default each grader runs as training runs it, with `--eval` in a worker pool as eval does.
The shapes are what long responses look like to the graders' extractors: one long "Answer:" line, one
long \\boxed{...}, and LaTeX-like text with unclosed \\text{ and a single "$".
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

GRADERS = ("arith", "dapo", "answer_line", "boxed", "math_verify")
SHAPES = ("answer_line", "boxed", "latex")


def response(shape: str, size: int) -> str:
    """A response of `size` characters whose extracted answer is nearly all of it."""
    if shape == "answer_line":
        head = "Let me think.\nAnswer: "
        return head + ("12+" * size)[: size - len(head)]
    if shape == "boxed":
        head, tail = "So the result is \\boxed{", "}."
        return head + ("1+" * size)[: size - len(head) - len(tail)] + tail
    head = "Answer: $x"
    return head + ("\\text{a" * size)[: size - len(head)]


def time_one(grader_name: str, shape: str, size: int, pooled: bool) -> float:
    """In the child: seconds for grade + final_answer of one response."""
    from dsv4rl.reward.graders import get_grader

    grader = get_grader(grader_name, pooled=True) if pooled else get_grader(grader_name)
    try:
        grader.grade("Answer: 1", "1")  # start and warm a pool, if the grader has one
        text = response(shape, size)
        start = time.perf_counter()
        grader.grade(text, "12")
        grader.final_answer(text)
        return time.perf_counter() - start
    finally:
        getattr(grader, "close", lambda: None)()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--sizes", type=int, nargs="+", default=[16_000, 100_000])
    parser.add_argument("--graders", nargs="+", default=list(GRADERS), choices=GRADERS)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--limit", type=float, default=180.0, help="seconds before a case is abandoned")
    parser.add_argument("--eval", action="store_true", help="every grader in a worker pool, as eval runs it")
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    parser.add_argument("--child", nargs=3, metavar=("GRADER", "SHAPE", "SIZE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        name, shape, size = args.child
        print(json.dumps({"seconds": time_one(name, shape, int(size), args.eval)}))
        return 0
    rows = []
    print(f"{'grader':<12} {'shape':<12} {'chars':>8} {'seconds':>10}")
    for name in args.graders:
        for shape in args.shapes:
            for size in args.sizes:
                cmd = [sys.executable, __file__, "--child", name, shape, str(size), *["--eval"] * args.eval]
                try:
                    done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.limit, check=True)
                    seconds: float | None = json.loads(done.stdout.strip().splitlines()[-1])["seconds"]
                    shown = f"{seconds:10.3f}"
                except subprocess.TimeoutExpired:
                    seconds, shown = None, f"> {args.limit:.0f}".rjust(10)
                rows.append({"grader": name, "shape": shape, "chars": size, "seconds": seconds})
                print(f"{name:<12} {shape:<12} {size:>8} {shown}", flush=True)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        record = {"limit_s": args.limit, "eval": args.eval, "rows": rows}
        args.out.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
