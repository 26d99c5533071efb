"""vispe's shared training script: fine-tuning from timm weights, training from scratch, resolution sweeps.

Entry points: ``python -m train CONFIG [key=value ...]`` (`train.cli`) and
``python -m train.extrapolate CHECKPOINTS --sizes ...`` (`train.extrapolate`). Configs are typed
and validated (`train.config`); the loop (`train.engine`) is shared by every task
(`train.tasks`: ``classification`` today; detection, NeRF and VLM tasks plug in the same way).
"""
from vispe.extras import require

for _module in ('yaml', 'tqdm', 'PIL', 'torchvision'):  # the [train] extra: a clear error before any import fails
    require(_module, 'the training script (vispe_train)')

from .config import Config, ConfigError, load_config  # noqa: E402
from .tasks import Task, get_task, list_tasks, register_task  # noqa: E402

__all__ = ['Config', 'ConfigError', 'load_config', 'Task', 'register_task', 'get_task', 'list_tasks']
