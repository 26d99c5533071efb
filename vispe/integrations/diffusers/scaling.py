"""Frequency scaling of a diffusion transformer's own rotary, per axis and per denoising step.

The methods are the entries of vispe's one frequency-scaling table (`vispe.rotary.frequencies`):
``'linear'`` (position interpolation), ``'ntk'`` (NTK-aware base), ``'yarn'`` (YaRN by parts, with its
attention temperature) and ``'riflex'`` (RIFLEx's intrinsic-frequency reduction). Each scaled axis of a
host (``'h'`` / ``'w'`` for image hosts, ``'t'`` / ``'h'`` / ``'w'`` for video hosts) has its own method and
options (`AxisScaling`); its factor is the axis' length in this forward over its training length, or a
fixed factor (``target``). A schedule ``schedule(t, axis)`` may change an axis' options at each denoising
step: ``t`` is the noise level of the step in [0, 1] (1 = pure noise), read from the transformer's
``timestep`` argument once per forward.
"""
from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch

from ...rotary.frequencies import FREQUENCY_SCALING, scale_axis_frequencies

__all__ = ['AxisScaling', 'DiTScaling', 'Schedule', 'ScalingSpec']

Schedule = Callable[[float, str], Optional[Union[str, Mapping[str, Any]]]]
ScalingSpec = Union[str, Mapping[str, Union[str, Mapping[str, Any]]]]
_OPTION_NAMES = ('scaling', 'factor', 'yarn_beta_fast', 'yarn_beta_slow', 'riflex_repetition')


@dataclass(frozen=True)
class AxisScaling:
    """The scaling of one coordinate axis.

    Attributes:
        scaling: a method of `vispe.rotary.frequencies.FREQUENCY_SCALING`.
        factor: a fixed factor; None: the axis' length in this forward over its training length.
        yarn_beta_fast, yarn_beta_slow: YaRN's ramp (turns over the training length), fast > slow >= 0.
        riflex_repetition: RIFLEx's repetition length in positions of this axis (None: its training length).
    """
    scaling: str = 'none'
    factor: Optional[float] = None
    yarn_beta_fast: float = 32.0
    yarn_beta_slow: float = 1.0
    riflex_repetition: Optional[float] = None

    def __post_init__(self) -> None:
        if self.scaling not in FREQUENCY_SCALING:
            raise ValueError(f'scaling must be one of {tuple(FREQUENCY_SCALING)}, got {self.scaling!r}')
        for name in ('factor', 'riflex_repetition'):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real) or value <= 0):
                raise ValueError(f'{name} must be a positive number or None, got {value!r}')
        fast, slow = self.yarn_beta_fast, self.yarn_beta_slow
        if not (isinstance(slow, numbers.Real) and isinstance(fast, numbers.Real) and 0 <= slow < fast):
            raise ValueError(f'yarn_beta_fast and yarn_beta_slow must be numbers with fast > slow >= 0, got '
                             f'{fast!r} and {slow!r}')

    def replace(self, change: Union[None, str, Mapping[str, Any]], who: str) -> 'AxisScaling':
        """These options with ``change`` (a method name, a mapping of options, or None: unchanged)."""
        if change is None:
            return self
        if isinstance(change, str):
            return dataclasses.replace(self, scaling=change)
        if not isinstance(change, Mapping):
            raise TypeError(f'{who} must give a method name, a mapping of options {_OPTION_NAMES} or None, got '
                            f'{type(change).__name__}')
        unknown = set(change) - set(_OPTION_NAMES)
        if unknown:
            raise ValueError(f'{who} gave unknown scaling options {sorted(unknown)}; the options are {_OPTION_NAMES}')
        return dataclasses.replace(self, **change)

    def frequencies(self, freqs: torch.Tensor, length: Optional[float], train_length: float
                    ) -> Tuple[torch.Tensor, float]:
        """``freqs`` scaled for an axis of ``length`` positions (trained at ``train_length``), and the
        magnitude of cos / sin (YaRN's temperature, else 1)."""
        if self.scaling == 'none':
            return freqs, 1.0
        factor = self.factor if self.factor is not None else (length or train_length) / train_length
        return scale_axis_frequencies(freqs, factor, self.scaling, float(train_length), self.yarn_beta_fast,
                                      self.yarn_beta_slow, self.riflex_repetition)


class DiTScaling:
    """The scaling of every scaled axis of one host, and the schedule that may change it per step.

    Args:
        axes: the names of the host's scaled axes, e.g. ``('h', 'w')`` or ``('t', 'h', 'w')``.
        train: the training length of each of them (tokens).
        scaling: one method for every axis, or ``{axis: method or options}`` (axes left out: ``'none'``).
        target: fixed lengths (tokens) per axis instead of each forward's lengths, or None.
        schedule: ``schedule(t, axis) -> method | options | None`` (module docstring).
        defaults: options shared by every axis (``yarn_beta_fast``, ``yarn_beta_slow``, ``riflex_repetition``).
    """

    def __init__(self, axes: Sequence[str], train: Sequence[int], scaling: ScalingSpec = 'none',
                 target: Optional[Sequence[int]] = None, schedule: Optional[Schedule] = None,
                 **defaults: Any) -> None:
        self.axes, self.train = tuple(axes), tuple(int(t) for t in train)
        base = AxisScaling(**defaults)
        if isinstance(scaling, str):
            per_axis: Dict[str, AxisScaling] = {a: base.replace(scaling, 'scaling') for a in self.axes}
        elif isinstance(scaling, Mapping):
            unknown = set(scaling) - set(self.axes)
            if unknown:
                raise ValueError(f'scaling names axes {sorted(unknown)}; this host scales the axes {self.axes}')
            per_axis = {a: base.replace(scaling.get(a, 'none'), f'scaling[{a!r}]') for a in self.axes}
        else:
            raise TypeError(f'scaling must be a method name {tuple(FREQUENCY_SCALING)} or a mapping axis -> method or '
                            f'options, got {type(scaling).__name__}')
        if target is not None:
            target = tuple(target)
            if len(target) != len(self.axes):
                raise ValueError(f'target must give one length per scaled axis {self.axes}, got {target!r}')
            per_axis = {a: dataclasses.replace(s, factor=t / n) for (a, s), t, n in
                        zip(per_axis.items(), target, self.train)}
        if schedule is not None and not callable(schedule):
            raise TypeError(f'schedule must be a callable (t, axis) -> scaling options, got {type(schedule).__name__}')
        self.per_axis, self.schedule = per_axis, schedule

    @property
    def active(self) -> bool:
        """Whether any axis may be scaled (a method other than ``'none'``, or a schedule)."""
        return self.schedule is not None or any(s.scaling != 'none' for s in self.per_axis.values())

    def at(self, t: Optional[float]) -> Dict[str, AxisScaling]:
        """Each axis' options at noise level ``t`` (the schedule's, where it gives any)."""
        if self.schedule is None:
            return self.per_axis
        if t is None:
            raise ValueError('a scaling schedule needs the timestep of the forward: call the transformer with '
                             'timestep=')
        return {a: s.replace(self.schedule(t, a), 'schedule') for a, s in self.per_axis.items()}

    def axis_frequencies(self, options: Dict[str, AxisScaling], axis: str, freqs: torch.Tensor,
                         length: Optional[float]) -> Tuple[torch.Tensor, float]:
        """``freqs`` of scaled axis ``axis`` for a length of ``length`` positions under ``options``."""
        i = self.axes.index(axis)
        return options[axis].frequencies(freqs, length, self.train[i])

    def describe(self) -> str:
        parts = [f'{a}: {s.scaling}' + (f' x{s.factor:g}' if s.factor else '') for a, s in self.per_axis.items()]
        return ', '.join(parts) + (', scheduled' if self.schedule is not None else '')


def noise_level(timestep: Any, scale: float) -> Optional[float]:
    """The one noise level in [0, 1] of a forward's ``timestep`` argument (host units / ``scale``)."""
    if timestep is None:
        return None
    t = torch.as_tensor(timestep).detach().flatten()
    if t.numel() == 0:
        return None
    lo, hi = float(t.min()), float(t.max())
    if not math.isclose(lo, hi, rel_tol=0, abs_tol=1e-6 * max(1.0, abs(hi))):
        raise ValueError(f'a scaling schedule takes one timestep per forward; this batch has timesteps from {lo} to '
                         f'{hi} (run the samples of different steps in separate calls)')
    return hi / scale


def tokens_of(target: Optional[Sequence[int]], per_token: Sequence[Callable[[int], int]], who: str
              ) -> Optional[List[int]]:
    """Pixel (and frame) sizes ``target`` as token lengths, one conversion per axis."""
    if target is None:
        return None
    if not isinstance(target, (tuple, list)) or len(target) != len(per_token) or not all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in target):
        raise ValueError(f'target must be {len(per_token)} positive integers ({who}), got {target!r}')
    return [max(1, convert(v)) for convert, v in zip(per_token, target)]
