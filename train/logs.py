"""Feedback of a run: console logging, progress bars, CSV files, TensorBoard, the final summary.

Only rank 0 writes anything; other ranks log warnings and errors only.
"""
from __future__ import annotations

import csv
import importlib.util
import logging
import sys
from pathlib import Path
from typing import Any, Dict, List, Sequence

from tqdm import tqdm

from .config import ConfigError

__all__ = ['setup_logging', 'add_file_log', 'progress', 'CsvLog', 'TensorBoardLog', 'tensorboard_enabled',
           'format_table']

_FORMAT = '%(asctime)s %(levelname)s %(name)s: %(message)s'


class _StdoutHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stdout`` is at the time (it may be replaced, e.g. by pytest)."""

    def __init__(self) -> None:
        super().__init__(sys.stdout)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass


def setup_logging(rank: int, level: str = 'info') -> None:
    """Console logging: ``level`` on rank 0, warnings only on the other ranks."""
    root = logging.getLogger()
    for h in [h for h in root.handlers if isinstance(h, _StdoutHandler)]:
        root.removeHandler(h)
    handler = _StdoutHandler()
    handler.setFormatter(logging.Formatter(_FORMAT if rank == 0 else f'[rank {rank}] {_FORMAT}', '%H:%M:%S'))
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()) if rank == 0 else logging.WARNING)


def add_file_log(path: Path) -> logging.Handler:
    """Also log to ``path`` (the run's ``log.txt``); returns the handler so the run can remove it."""
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter(_FORMAT))
    logging.getLogger().addHandler(handler)
    return handler


def progress(mode: str, is_main: bool, **kwargs: Any) -> tqdm:
    """A tqdm bar, shown on rank 0 when ``mode`` is 'on', or 'auto' and stderr is a terminal."""
    show = is_main and (mode == 'on' or (mode == 'auto' and sys.stderr.isatty()))
    return tqdm(disable=not show, dynamic_ncols=True, leave=False, **kwargs)


class CsvLog:
    """Rows of scalars appended to a CSV file; new columns rewrite the header, rows keep their values.

    ``truncate(step)`` drops rows written after ``step`` (a resumed run repeats them).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.columns: List[str] = []
        self.rows: List[Dict[str, Any]] = []
        if path.is_file():
            with open(path, newline='') as f:
                reader = csv.DictReader(f)
                self.columns = list(reader.fieldnames or [])
                self.rows = list(reader)

    def truncate(self, step: int) -> None:
        keep = [r for r in self.rows if int(float(r.get('step') or 0)) <= step]
        if len(keep) != len(self.rows):
            self.rows = keep
            self._rewrite()

    def write(self, row: Dict[str, Any]) -> None:
        row = {k: _fmt(v) for k, v in row.items()}
        self.rows.append(row)
        if any(k not in self.columns for k in row):
            self.columns += [k for k in row if k not in self.columns]
            self._rewrite()
            return
        with open(self.path, 'a', newline='') as f:
            csv.DictWriter(f, self.columns).writerow(row)

    def _rewrite(self) -> None:
        tmp = self.path.with_suffix('.csv.tmp')
        with open(tmp, 'w', newline='') as f:
            w = csv.DictWriter(f, self.columns)
            w.writeheader()
            w.writerows(self.rows)
        tmp.replace(self.path)


def _fmt(v: Any) -> Any:
    if isinstance(v, float):
        return f'{v:.6g}'
    return v


def tensorboard_enabled(mode: str) -> bool:
    """Whether ``log.tensorboard=mode`` writes events; 'on' without the package is a `ConfigError`.

    The trainer asks before it builds anything, so the run stops before its first step.
    """
    installed = importlib.util.find_spec('tensorboard') is not None
    if mode == 'on' and not installed:
        raise ConfigError("log.tensorboard: 'on' needs the tensorboard package, which is not installed; "
                          'pip install "vispe[tensorboard]", or set log.tensorboard=auto (events when installed) or off')
    return mode != 'off' and installed


class TensorBoardLog:
    """TensorBoard scalars in ``log_dir`` when ``enabled`` (see `tensorboard_enabled`).

    ``resumed_step``: the step a resumed run continues after; the events a killed run wrote beyond it
    are purged (SummaryWriter's ``purge_step``), as `CsvLog.truncate` drops its rows, so that the
    repeated steps are not shown twice."""

    def __init__(self, enabled: bool, log_dir: Path, resumed_step: int = 0) -> None:
        self.writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(log_dir), purge_step=resumed_step + 1 if resumed_step else None)

    def write(self, prefix: str, scalars: Dict[str, Any], step: int) -> None:
        if self.writer is None:
            return
        for k, v in scalars.items():
            if isinstance(v, (int, float)) and k not in ('step', 'epoch'):
                self.writer.add_scalar(f'{prefix}/{k}', v, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def format_table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A Markdown table (numbers with one decimal)."""
    cells = [[f'{c:.1f}' if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(header)]
    line = lambda r: '| ' + ' | '.join(str(c).ljust(w) for c, w in zip(r, widths)) + ' |'  # noqa: E731
    sep = '|' + '|'.join('-' * (w + 2) for w in widths) + '|'
    return '\n'.join([line(header), sep] + [line(r) for r in cells])
