"""`python -m dsv4rl.engine --model-path DIR [--port P] ...`: the CPU reference engine (SGLang flag names,
`dsv4rl.engine.args`)."""

from __future__ import annotations

if __name__ == "__main__":
    from dsv4rl.faults.child import child_process

    with child_process("engine"):
        from dsv4rl.engine.server import main

        main()
