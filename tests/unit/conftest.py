"""Unit tests run torch on one thread: small ops on two cores gain nothing from more, and results do not
depend on how many the machine has."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
