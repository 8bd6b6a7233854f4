"""echo2: distributed GRPO post-training with vLLM rollout workers and BitTorrent weight broadcast."""

__version__ = "0.3.0"
