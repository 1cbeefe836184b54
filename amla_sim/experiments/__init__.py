"""Experiments: input distributions, error metrics, and (later) the papers' tables."""
