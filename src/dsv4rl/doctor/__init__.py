"""`dsv4rl doctor`: checks of a cluster node before a run (software, GPUs, host, RDMA, environment, network,
storage), each with a verdict and a one-line remedy.

Every check reads the machine through `probe.SystemProbe`, so tests replay recorded machine states
(`probe.RecordedProbe`, tests/doctor/states/*.json) and the verdicts stay pure functions of what was read.
"""
