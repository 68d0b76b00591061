"""deltarule's layers in HF kernels' local repository layout (deltarule.integrations.hf_kernels)."""
from deltarule.integrations import hf_kernels as layers  # noqa: F401
