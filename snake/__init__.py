"""snake: train LLMs bigger than GPU memory by streaming them through the GPU layer by layer."""

from snake.adapters import ModelParts
from snake.config import AdamW, DynamicLossScale, Placement, SnakeConfig, tiny_cpu
from snake.epochs import Epochs
from snake.errors import (
    ActorFailed,
    ConfigError,
    DataError,
    DataExhausted,
    GradientOverflow,
    ModelError,
    SnakeError,
    StallError,
    StorageError,
)
from snake.evaluate import EvalReport
from snake.trainer import RunReport, SnakeTrainer

__all__ = [
    "AdamW",
    "ActorFailed",
    "GradientOverflow",
    "ConfigError",
    "DataError",
    "DataExhausted",
    "DynamicLossScale",
    "Epochs",
    "EvalReport",
    "ModelError",
    "ModelParts",
    "RunReport",
    "SnakeTrainer",
    "Placement",
    "SnakeConfig",
    "SnakeError",
    "StallError",
    "StorageError",
    "tiny_cpu",
]
