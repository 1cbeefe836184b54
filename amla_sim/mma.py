"""``amla_sim.mma``: the tensor-core models of :mod:`amla_sim.arith.mma` under their public name."""

from .arith.mma import MODEL_TABLE, MODELS, TFDPA, MMAModel, get_model, matmul, t_fdpa

__all__ = ["matmul", "MODEL_TABLE", "MODELS", "MMAModel", "TFDPA", "get_model", "t_fdpa"]
