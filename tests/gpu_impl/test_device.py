"""The one function that picks gpu_impl's device."""

from __future__ import annotations

import pytest
import torch

from kvspec.gpu_impl.device import DEVICE_ENV_VAR, cuda_available, device_problem, pick_device
from kvspec.spec.errors import InvalidRequest


def test_none_picks_cuda_when_present_else_the_cpu(monkeypatch):
    monkeypatch.delenv(DEVICE_ENV_VAR, raising=False)
    assert pick_device().type == ("cuda" if cuda_available() else "cpu")


def test_an_explicit_device_wins_over_the_environment(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cuda:7")
    assert pick_device("cpu") == torch.device("cpu")
    assert pick_device(torch.device("cpu")) == torch.device("cpu")


def test_the_environment_overrides_the_default(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")
    assert pick_device() == torch.device("cpu")


@pytest.mark.parametrize(
    ("name", "message"),
    [("tpu:0", r"^device='tpu:0' is not a device name torch knows"), ("meta", r"^device='meta': gpu_impl runs on")],
)
def test_unusable_names_are_refused(name, message):
    with pytest.raises(InvalidRequest, match=message):
        pick_device(name)


def test_cuda_is_refused_where_there_is_none_and_indexed_where_there_is():
    if cuda_available():
        assert pick_device("cuda") == torch.device("cuda", torch.cuda.current_device())
        with pytest.raises(InvalidRequest, match=r"CUDA devices$"):
            pick_device(f"cuda:{torch.cuda.device_count()}")
    else:
        with pytest.raises(InvalidRequest, match=r"^device='cuda' but this machine has no usable CUDA device"):
            pick_device("cuda")


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "gpu please")
    with pytest.raises(InvalidRequest, match=rf"^{DEVICE_ENV_VAR}='gpu please' is not a device name"):
        pick_device()


def test_a_device_that_does_not_exist_here_is_named_and_another_runtimes_left_alone(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV_VAR, "cpu")  # the question is about the name given, never the environment
    assert device_problem("cpu") is None
    assert device_problem("tpu:0") is None and device_problem("meta") is None  # not CUDA: the adapter's to judge
    many = torch.cuda.device_count() if cuda_available() else 0
    assert device_problem(f"cuda:{many + 98}") is not None
    assert device_problem(f"cuda:{many + 98}").startswith(f"device='cuda:{many + 98}' but this machine has ")
    assert (device_problem("cuda:0") is None) is cuda_available()
