"""hettp: heterogeneous tensor parallelism.

The framework-agnostic core: torch and torch.distributed only, never megatron. The Megatron
integration lives in megatron/hetero/.
"""

__version__ = "0.1.0"
