"""Rollout plane: join the learner, fetch policy versions from the swarm, generate with vLLM."""
