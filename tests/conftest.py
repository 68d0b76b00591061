import numpy as np
import pytest
import torch

from deltarule import cases
from deltarule.backends import cpu_backend

CPU = pytest.param("cpu", marks=pytest.mark.skipif(
    not cpu_backend.available(), reason="the cpu backend needs numba: pip install 'deltarule[cpu]'"))


def case_params(filter_=lambda case: True, dtypes=None):
    """pytest params (case, dtype) over test.json, with ids like `gdn-B2-T65-H4-K32-float32`."""
    return [
        pytest.param(case, dtype, id=f"{case['name']}-{dtype}")
        for case in cases.test_cases() if filter_(case)
        for dtype in case["dtypes"] if dtypes is None or dtype in dtypes
    ]


def rel(a, b) -> float:
    a = a.detach().double().numpy() if isinstance(a, torch.Tensor) else np.asarray(a, dtype=np.float64)
    b = b.detach().double().numpy() if isinstance(b, torch.Tensor) else np.asarray(b, dtype=np.float64)
    den = np.linalg.norm(b)
    return float(np.linalg.norm(a - b) / den) if den > 0 else float(np.linalg.norm(a))


@pytest.fixture
def nan_poison():
    """Uninitialised torch memory reads as NaN: an unwritten output element shows up."""
    previous = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(previous)
    torch.utils.deterministic.fill_uninitialized_memory = fill
