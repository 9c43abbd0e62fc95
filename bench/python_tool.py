"""What the python tool's isolation costs a call: `python bench/python_tool.py [--calls 20] [--out r.json]`.

Each mode this machine accepts runs the same `print(1)` `--calls` times through `PythonTool.call` (one
trajectory, the calls one after another); the baseline is the bare interpreter the sandbox starts
(`python -I -c "print(1)"` as a subprocess, nothing set up). Printed: the median milliseconds of each and
its ratio to the baseline, measured in one run; `--python` picks the interpreter (landlock and rlimits
need one a trajectory's uid can read, e.g. /usr/bin/python3, when run as root).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

MODES = (("namespaces", {}), ("landlock", {}), ("rlimits", {"trust_model_code": True}))


def bare(python: str, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        subprocess.run([python, "-I", "-c", "print(1)"], check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def through_tool(tool, calls: int) -> float:
    state = await tool.open(None)
    times = []
    try:
        for _ in range(calls):
            start = time.perf_counter()
            result = await tool.call(state, {"code": "print(1)"})
            times.append(time.perf_counter() - start)
            assert result.text == "1\n", result.text
    finally:
        await tool.close(state)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--out", type=Path, help="write the rows as JSON")
    args = parser.parse_args()
    from dsv4rl.tools.python_tool import PythonTool
    from dsv4rl.tools.sandbox.isolation import IsolationUnavailable

    base = bare(args.python, args.calls)
    rows = [{"mode": "bare interpreter", "median_ms": base * 1e3, "ratio": 1.0}]
    for mode, extra in MODES:
        try:
            tool = PythonTool(isolation=mode, python=args.python, **extra)
        except IsolationUnavailable as error:
            rows.append({"mode": mode, "refused": str(error)[:200]})
            continue
        median = asyncio.run(through_tool(tool, args.calls))
        rows.append({"mode": mode, "median_ms": median * 1e3, "ratio": median / base})
    for row in rows:
        if "refused" in row:
            print(f"{row['mode']:>18}: refused here ({row['refused']})")
        else:
            ms, ratio = row["median_ms"], row["ratio"]
            print(f"{row['mode']:>18}: {ms:6.1f} ms a call, {ratio:.2f}x the bare interpreter")
    if args.out:
        args.out.write_text(json.dumps({"python": args.python, "calls": args.calls, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
