"""Experiments: input distributions, error metrics, the papers' tables, user grids, the result store and the
schedulers that run sweeps."""
