"""hettp's Megatron integration: megatron-core glue, arguments, training loop, CPU shims.

Lives in the `megatron` namespace package beside megatron-core (there is deliberately no
megatron/__init__.py).
"""
