"""What the property tests of every op share: the dtypes, the hypothesis profile, the layouts.

Each op's test file declares its property tests in ``PROPERTIES`` (hypothesis tests, named without
the ``test_`` prefix); ``tests/test_properties.py`` runs them for every family in the op registry.
Random shapes (0 and 1 included), strided and transposed views, every dtype and every option;
no crash, and no NaN where the oracle has none (the oracle checks compare finite entries and
require the same non-finite ones). Derandomized and without a database, so CI runs the same
examples every time; max_examples keeps each op well under a minute on 2 cores.
"""

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
PROFILE = settings(deadline=None, derandomize=True, database=None, print_blob=True,
                   suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                          HealthCheck.function_scoped_fixture])


def layout(draw, shape, generator, dtype, name):
    """A tensor of `shape` as a contiguous tensor, a transposed view of the reversed-last-two
    storage, a strided slice of a wider one, or (for a leading size of 1) an expanded one."""
    layout = draw(st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]), label=f"{name} layout")
    shape = list(shape)
    if layout == "transposed" and len(shape) >= 2:
        storage = torch.randn(*shape[:-2], shape[-1], shape[-2], generator=generator).to(dtype)
        return storage.transpose(-1, -2)
    if layout == "sliced" and shape:
        storage = torch.randn(*shape[:-1], 2 * shape[-1] + 1, generator=generator).to(dtype)
        return storage[..., 1::2]
    if layout == "expanded" and shape:
        return torch.randn(1, *shape[1:], generator=generator).to(dtype).expand(shape)
    return torch.randn(shape, generator=generator).to(dtype)
