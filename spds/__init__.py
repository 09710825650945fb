"""spds: soft-prompt distillation on a frozen causal LM, exact and resumable, on DeepSpeed."""

__version__ = "0.1.0"
