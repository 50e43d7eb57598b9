"""CUDA tensors on backend "comm". These need a GPU; on a machine without one they skip.

Where commGetFeatures reports COMM_FEATURE_DEVICE_MEMORY (libcomm found a CUDA driver and a
GPU), the scenario checks the results against gloo's; where it does not, the backend must
refuse CUDA tensors with a RuntimeError that says so."""

import pytest
import torch

import launcher

NO_GPU = "no GPU: torch.cuda.is_available() is False on this machine"


@pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
def test_cuda_tensors():
    results = launcher.run("cuda_ops", 2, timeout=180)
    for name in results[0]["checks"]:
        failures = launcher.failed_checks(results, name)
        assert not failures, "\n".join(failures)
