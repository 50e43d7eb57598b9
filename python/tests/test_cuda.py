"""CUDA tensors on backend "comm". These need a GPU; on a machine without one they skip.

libcomm has no device path yet: while commGetFeatures lacks COMM_FEATURE_DEVICE_MEMORY the
backend refuses CUDA tensors with a RuntimeError that says so; once it reports the feature,
the same scenario checks results against gloo."""

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
