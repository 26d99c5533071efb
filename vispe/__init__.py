"""vispe: positional encodings for vision and multimodal transformers.

Positions are data (`vispe.positions`), encodings are functions of them (`vispe.encodings`),
attention applies them through one set of hooks (`vispe.attention`), and `import vispe` registers
PE-swappable ViTs in timm (``timm.create_model('vit_base', pe='rope_mixed')``).
"""
from . import positions
from .positions import Image, Positions, Text, Video, grid, points, sequence
from .contract import Capabilities, ComposedPE, PEContext, PositionalEncoding, PreparedPE
from . import encodings  # registers every encoding
from .registry import create_pe, format_pe_spec, list_pes, parse_pe_spec, pe_info, register_pe
from .attention import pe_attention
from .layers import PEAttention
from .vit import VisionTransformer
from .weights import load_timm_checkpoint
from .zoo import convert, timm_pe_spec, unwrap_timm_entrypoints, wrap_timm_entrypoints
from .naflex import naflex_batch, naflex_positions, naflex_size
from .cameras import Cameras, plucker_rays
from .doctor import doctor

__version__ = '0.1.0'

__all__ = [
    'positions', 'Positions', 'grid', 'points', 'sequence', 'Text', 'Image', 'Video',
    'PositionalEncoding', 'PEContext', 'ComposedPE', 'Capabilities', 'PreparedPE',
    'register_pe', 'create_pe', 'list_pes', 'parse_pe_spec', 'format_pe_spec', 'pe_info',
    'PEAttention', 'pe_attention', 'VisionTransformer', 'load_timm_checkpoint', 'convert', 'timm_pe_spec',
    'wrap_timm_entrypoints', 'unwrap_timm_entrypoints',
    'naflex_batch', 'naflex_size', 'naflex_positions',
    'Cameras', 'plucker_rays', 'doctor',
]


def __getattr__(name: str):
    if name == 'multimodal':  # deprecated (one release): imported on first use, which warns
        import importlib
        return importlib.import_module('.multimodal', __name__)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
