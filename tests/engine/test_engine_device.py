"""The engine's device option: a device this PyTorch cannot use is refused before any weight is read, with what to
do instead."""

from __future__ import annotations

import pytest
import torch

from tokenriver.engine.core import check_device
from tokenriver.errors import InvalidParameterError


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_refused_with_what_to_do():
    with pytest.raises(InvalidParameterError, match="sees no CUDA GPU.*--device cpu") as caught:
        check_device("cuda")
    assert caught.value.param == "device"


@pytest.mark.parametrize("device", ["gpu0", "tpu", "cuda:x"])
def test_unknown_devices_are_refused(device):
    with pytest.raises(InvalidParameterError) as caught:
        check_device(device)
    assert caught.value.param == "device"


def test_the_cpu_is_accepted():
    check_device("cpu")
