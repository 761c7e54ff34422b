"""The trainer: async GRPO on captured agent traces (``HarnessAsyncGRPOTrainer``).

Pure data shaping and math (rows, advantages, packing, loss) live in their own modules and are tested
without servers; the loop (scheduling rollouts, training steps, weight sync, checkpoints) sits at the edge.
"""
