"""``python -m train CONFIG [key=value ...]`` (see `train.cli`)."""
import sys

from .cli import main

sys.exit(main())
