"""Positions and their builders: the answer to *where is each token*."""
from .core import GridMode, Positions, grid, grid_coordinates, naflex_grid, points
from .multimodal import Image, MultimodalPositions, SegmentTable, Text, Video, sequence
from .multiview import multiview, view_grid
from .padding import PaddedGrid, pack_padded_grid, unpadded_extents

__all__ = ['Positions', 'GridMode', 'grid', 'naflex_grid', 'points', 'grid_coordinates', 'multiview', 'view_grid',
           'PaddedGrid', 'pack_padded_grid', 'unpadded_extents', 'sequence', 'Text', 'Image', 'Video',
           'MultimodalPositions', 'SegmentTable']
