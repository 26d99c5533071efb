"""Datasets and samplers of the training script: the embedded synthetic data and image folders."""
from .folder import ImageFolderDataset, split_dir
from .naflex import NaFlexCollate, NaFlexScenes
from .samplers import ShardSampler, TrainSampler, make_loader
from .synthetic import SpatialShapes

__all__ = ['SpatialShapes', 'ImageFolderDataset', 'split_dir', 'TrainSampler', 'ShardSampler', 'make_loader',
           'NaFlexScenes', 'NaFlexCollate']
