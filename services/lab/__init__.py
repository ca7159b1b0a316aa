"""The lab: what measures octoserve rather than serves with it. The policy-comparison suite and its report
(`bench_suite`, `bench_report`, `bench_command`), the baselines it compares against (`baselines`), the gang bench
(`gang_bench`), the live-vs-simulator agreement harnesses (`agreement`, `elastic_agreement`, `gang_agreement`), the
cost-model calibration (`calibrate`), `make run`'s demo (`demo`) and the user-workload suite (`user_suite`).

Nothing in the product or the simulator imports it; only the lab itself and the command line's root
(`octoserve.services.cli`) do (tests/test_layers.py).
"""
