"""What a run's processes leave in `<run_dir>/logs` so that the supervisor can say why a run failed or hung.

Every child of the node supervisor (engine, trainer rank, evaluating process) enters `child_process` at
start. It then dumps every thread's Python stack into `stacks-<process>.txt` on SIGUSR1, writes
`heartbeat-<process>.json` whenever it enters a phase, `notice-<process>.jsonl` for what the console must
show, and `crash-<process>.json` when an exception ends it. The supervisor reads these
(`dsv4rl.launcher.watchdog`, `dsv4rl.launcher.root_cause`). Test hooks make a process hang or die at a
named point (`dsv4rl.faults.inject`); `files` writes what must survive a crash durably (fsync, rename).

The children import this package, so it imports nothing from `dsv4rl.launcher`.
"""
