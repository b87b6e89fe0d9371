"""Data: the built-in procedural dataset, the ImageNet-layout and streaming datamodules, their protocol."""
from .datamodules import ImageFolderDataModule, ProceduralDataModule
from .procedural import MAX_CLASSES, SHAPES, ProceduralShapes
from .protocol import BatchSizeControllable, ResolutionControllable, require_protocol
from .streaming import StreamingDataModule

__all__ = [
    "BatchSizeControllable",
    "ImageFolderDataModule",
    "MAX_CLASSES",
    "ProceduralDataModule",
    "ProceduralShapes",
    "ResolutionControllable",
    "SHAPES",
    "StreamingDataModule",
    "require_protocol",
]
