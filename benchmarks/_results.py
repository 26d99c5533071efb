"""Benchmark results as data: one JSON file per run, stamped with when, where and with what it ran.

The docs' tables and plots are made from these files by ``benchmarks/make_figures.py`` and never
typed by hand, so every figure carries the date, the hardware and the library versions of its run.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any, Dict, Optional

import torch

__all__ = ['environment', 'write_results']

_ROOT = Path(__file__).resolve().parents[1]


def _cpu_name() -> str:
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            if line.startswith('model name'):
                return line.split(':', 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _git_commit() -> Optional[str]:
    try:
        out = subprocess.run(['git', '-C', str(_ROOT), 'rev-parse', '--short', 'HEAD'], capture_output=True,
                             text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def environment(device: torch.device = torch.device('cpu')) -> Dict[str, Any]:
    """Date (UTC), hardware and versions of the process measuring now."""
    import timm
    import vispe
    hardware = f'{_cpu_name()}, {os.cpu_count()} logical cores, {torch.get_num_threads()} torch thread(s)'
    if device.type == 'cuda':
        hardware = f'{torch.cuda.get_device_name(device)} (CUDA {torch.version.cuda}); host: {hardware}'
    return dict(
        date=datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC'),
        hardware=hardware, device=device.type,
        versions=dict(python=platform.python_version(), torch=torch.__version__, timm=timm.__version__,
                      vispe=vispe.__version__, commit=_git_commit()),
    )


def write_results(path: str, kind: str, command: str, params: Dict[str, Any], results: Any,
                  device: torch.device = torch.device('cpu'), env: Optional[Dict[str, Any]] = None) -> None:
    """Write one run's results with its environment. ``kind`` tells make_figures how to draw it."""
    record = dict(kind=kind, command=command, params=params, environment=env or environment(device),
                  results=results)
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(record, indent=1, sort_keys=False) + '\n')
