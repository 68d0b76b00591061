"""deltarule: the generalized gated delta rule, one contract, several backends."""

from .api import linear_attention, validate
from . import conv  # noqa: F401 - registers the short convolution's op (deltarule.conv.custom_ops)
from .backends import info as backend_info
from .backends.wgsl_slab import WgslStateSlab
from .batch import BatchPlan, plan_batch
from .errors import ContractError, Unsupported
from .gate import gate
from .replay import replay

__version__ = "0.1.0"

__all__ = ["linear_attention", "validate", "plan_batch", "BatchPlan", "backend_info", "gate", "replay", "ContractError",
           "Unsupported", "WgslStateSlab", "__version__"]
