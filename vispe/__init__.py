"""vispe: positional encodings for vision and multimodal transformers.

Positions are data (`vispe.positions`), encodings are functions of them (`vispe.encodings`),
attention applies them through one set of hooks (`vispe.attention`), and `import vispe` registers
PE-swappable ViTs in timm (``timm.create_model('vit_base', pe='rope_mixed')``).
"""
from . import positions
from .positions import Positions, grid, points
from .encodings import Capabilities, ComposedPE, PEContext, PositionalEncoding
from .registry import create_pe, format_pe_spec, list_pes, parse_pe_spec, pe_info, register_pe
from .attention import PEAttention, pe_attention
from .vit import VisionTransformer, load_timm_checkpoint
from .zoo import convert, timm_pe_spec
from .naflex import naflex_batch, naflex_positions, naflex_size
from .cameras import Cameras, plucker_rays
from . import multimodal

__version__ = '0.1.0'

__all__ = [
    'positions', 'Positions', 'grid', 'points',
    'PositionalEncoding', 'PEContext', 'ComposedPE', 'Capabilities',
    'register_pe', 'create_pe', 'list_pes', 'parse_pe_spec', 'format_pe_spec', 'pe_info',
    'PEAttention', 'pe_attention', 'VisionTransformer', 'load_timm_checkpoint', 'convert', 'timm_pe_spec',
    'naflex_batch', 'naflex_size', 'naflex_positions',
    'Cameras', 'plucker_rays', 'multimodal',
]
