"""Learning plane: coordinator (leases, staleness, tracker), GRPO trainer, publisher, checkpoints."""
