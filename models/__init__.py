"""End-to-end HSTU ranking model, synthetic jagged data and the training entry point."""

from .config import PRESETS, ModelConfig, get_config
from .data import JaggedBatch, SyntheticJaggedDataset, SyntheticSequences, collate_jagged, make_loader
from .hstu import HSTULayer, HSTURankingModel

__all__ = [
    "PRESETS",
    "HSTULayer",
    "HSTURankingModel",
    "JaggedBatch",
    "ModelConfig",
    "SyntheticJaggedDataset",
    "SyntheticSequences",
    "collate_jagged",
    "get_config",
    "make_loader",
]
