"""Tasks of the training script, keyed by ``task:`` in a config.

A task lives in ``train/tasks/<name>.py`` and registers itself with ``@register_task('<name>')``;
`get_task` imports the module of that name on first use, so a config only pays for (and only
depends on) the task it names.
"""
from .base import Task, get_task, list_tasks, register_task

__all__ = ['Task', 'register_task', 'get_task', 'list_tasks']
