"""The cluster tier: node headroom summaries, the cluster picker, and the simulator at cluster scale."""
