"""The node's processes on one machine: `octoserve up`'s launcher (`launcher`), one service's start, readiness
wait, stop and reap (`processes`), the supervisor that restarts a worker that died (`supervisor`) with its hang check
(`hang_watch`), and the launcher of the workers an elastic reconfiguration starts (`elastic_launch`)."""
