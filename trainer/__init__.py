"""The trainer role: builds the policy model, trains it by GRPO on verified groups, publishes checkpoints."""
