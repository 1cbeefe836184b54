"""Arithmetic models: tensor-core MMA, elementwise ops, reductions, global memory with atomics."""
