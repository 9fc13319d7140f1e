"""Built-in models."""

from snake.models.gpt import GPT, Block, GPTConfig

__all__ = ["GPT", "GPTConfig", "Block"]
