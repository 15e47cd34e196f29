"""``masc train``, ``masc eval``, ``masc check`` and ``masc models``: one module per command,
each registering its parser on the ``masc`` command line (the ``masc.commands`` entry points)."""

from training.cli.check import register_check
from training.cli.evaluate import register_eval
from training.cli.models import register_models
from training.cli.train import register_train

__all__ = ["register_check", "register_eval", "register_models", "register_train"]
