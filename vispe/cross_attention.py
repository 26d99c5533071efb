"""Which encodings a DETR-style decoder's cross-attention can take, and how (``cross_pe``).

In DETR's decoder (Carion et al., ECCV 2020) the keys of cross-attention are the encoder's image tokens,
which have positions; the queries are learned object queries, which have none. A host chooses what
the keys' positions do there (``cross_pe``):

* ``'additive'``: the encoding's additive part is added to the keys' input (DETR's arrangement);
* ``'keys'``: also the attention-side hooks, with the queries placed at the origin. A map of q, k, v
  or the output is then meaningful: a rotation of the queries at the origin is the identity, so a
  rotary encoding rotates the keys only. A term per query-key pair (a logit bias, a weights term:
  ``capabilities.needs_query_positions``) is a function of the pair's offset, which queries without
  positions do not have: such an encoding is refused here (it stays in encoder self-attention, as
  in the iRPE paper's DETR experiments);
* ``'none'``: no positions in cross-attention (DETR's ablation);
* ``'auto'``: ``'keys'``, or ``'additive'`` for an encoding that needs query positions.

`check_cross_pe` is that policy, shared by every host that runs a vispe encoding in such a decoder.
"""
from __future__ import annotations

from typing import Literal, Optional

from .contract import Capabilities

__all__ = ['CROSS_PE', 'CrossPE', 'check_cross_pe']

CrossPE = Literal['auto', 'keys', 'additive', 'none']
CROSS_PE = ('auto', 'keys', 'additive', 'none')


def check_cross_pe(capabilities: Capabilities, cross_pe: str, *, encoding: Optional[str] = None) -> str:
    """The ``cross_pe`` a decoder's cross-attention runs for an encoding of ``capabilities``, ``'auto'``
    resolved (module docstring).

    Args:
        capabilities: the encoding's `Capabilities` (of the whole composition).
        cross_pe: ``'auto'``, ``'keys'``, ``'additive'`` or ``'none'``.
        encoding: the encoding's spec, named in the error.

    Returns:
        ``'keys'``, ``'additive'`` or ``'none'``.

    Raises:
        ValueError: ``cross_pe`` is not one of the four, or it is ``'keys'`` for an encoding that needs
            query positions (``capabilities.needs_query_positions``: a logit bias such as ``irpe`` or
            ``swin_rpb``), which object queries do not have.
    """
    if not isinstance(cross_pe, str) or cross_pe not in CROSS_PE:
        raise ValueError(f'cross_pe must be one of {CROSS_PE}, got {cross_pe!r}')
    if cross_pe == 'auto':
        return 'additive' if capabilities.needs_query_positions else 'keys'
    if cross_pe == 'keys' and capabilities.needs_query_positions:
        what = 'this encoding' if encoding is None else f'encoding {encoding!r}'
        raise ValueError(f"cross_pe='keys' cannot take {what}: it adds a term per query-key pair (a logit bias "
                         f"or a weights term) that needs query positions, which cross-attention's object queries "
                         f"do not have; use cross_pe='additive' (its additive part on the keys, what 'auto' "
                         f"picks) or 'none'")
    return cross_pe
