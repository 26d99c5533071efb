"""Ending a process that used a gloo process group, and a probe that tells whether it ended safely.

Why: torch (2.14) keeps a process group's gloo threads alive after ``destroy_process_group()``
while anything still references the group, and torch's own DTensor caches do (through the
``DeviceMesh``) once a sharded module ran. A gloo worker thread frees each finished collective
after the waiting thread has moved on; when that drops the last reference to a tensor made in
Python, the thread needs the GIL. Once the interpreter is shutting down, CPython ends a thread
that asks for the GIL, here from inside a C++ destructor, and the process aborts with
"terminate called without an active exception" (SIGABRT). How often depends on scheduling, so
a test only sees it now and then. A process that used gloo therefore destroys its group and
leaves without interpreter shutdown (``leave``).

``python gloo_shutdown.py REPORT_DIR SCRIPT [ARGS]`` (or ``REPORT_DIR -m MODULE [ARGS]``) runs SCRIPT
(MODULE) as ``__main__`` and, should the interpreter shut down, writes the gloo threads alive at that
point to ``REPORT_DIR/rank<RANK>.txt``.
"""
from __future__ import annotations

import atexit
import os
import runpy
import sys
from pathlib import Path
from typing import List, NoReturn

GLOO_THREADS = ('pt_gloo_runloop', 'gloo_tcp_loop')  # the names torch and gloo give their threads


def gloo_threads() -> List[str]:
    """Names of this process's live gloo threads (Linux: ``/proc/self/task``)."""
    names = []
    for task in os.listdir('/proc/self/task'):
        try:
            name = Path(f'/proc/self/task/{task}/comm').read_text().strip()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        if name in GLOO_THREADS:
            names.append(name)
    return sorted(names)


def watch_shutdown(report: Path) -> None:
    """At interpreter shutdown (after any other exit handler), write the live gloo threads to ``report``."""
    atexit.register(lambda: report.write_text('\n'.join(gloo_threads())))


def leave(code: int = 0) -> NoReturn:
    """Destroy the default process group and end the process without interpreter shutdown."""
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == '__main__':
    out = Path(sys.argv[1])
    watch_shutdown(out / f'rank{os.environ.get("RANK", "0")}.txt')
    if sys.argv[2] == '-m':
        sys.argv = sys.argv[3:]
        sys.path[0] = os.getcwd()
        runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        sys.path[0] = str(Path(sys.argv[0]).resolve().parent)
        runpy.run_path(sys.argv[0], run_name='__main__')
