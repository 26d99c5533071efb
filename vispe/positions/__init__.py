"""Positions and their builders: the answer to *where is each token*."""
from .core import GridMode, Positions, grid, grid_coordinates, points

__all__ = ['Positions', 'GridMode', 'grid', 'points', 'grid_coordinates']
