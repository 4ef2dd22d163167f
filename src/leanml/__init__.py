"""leanml: cheaper, better industrial deep learning."""

__version__ = "0.1.0"
