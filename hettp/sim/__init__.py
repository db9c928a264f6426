"""A step-time simulator of Megatron GPT training (TP x PP x DP) over per-GPU speeds and
per-link costs, driving the project's own detector and planner (hettp.loop, unchanged) on
simulated timing reports. Pure: no process group, no torch tensors. scripts/simulate.py is its
command line."""
