"""tppo-jax: Truncated PPO (T-PPO) and VAPO for RL of reasoning LLMs, in JAX/Flax NNX."""
