import pytest
import torch

import tokamax_torch  # noqa: F401  (loads the ops)


@pytest.fixture(autouse=True)
def _seed_and_reset():
    torch.manual_seed(0)
    yield
    torch._dynamo.reset()
