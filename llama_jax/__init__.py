"""llama-jax: pre-training Llama 3 models with JAX and Flax, from a laptop CPU to GPU clusters."""

__version__ = "0.1.0"
