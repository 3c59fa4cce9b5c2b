"""The thread policy: apply_thread_policy sets torch's and the fused kernels' thread counts;
the default is one thread unless idle OpenMP threads wait passively."""
from __future__ import annotations

import pytest
import torch

from cext import fused as cfused
from engine.models import threads


@pytest.fixture
def restore_threads():
    torch_threads, kernel_threads = torch.get_num_threads(), cfused.get_num_threads()
    yield
    torch.set_num_threads(torch_threads)
    cfused.set_num_threads(kernel_threads)


def test_explicit_count_sets_both_pools(restore_threads):
    policy = threads.apply_thread_policy(1)
    assert policy.num_threads == 1 and policy.num_kernel_threads == 1
    assert torch.get_num_threads() == 1 and cfused.get_num_threads() == 1
    policy = threads.apply_thread_policy(3)
    assert torch.get_num_threads() == 3 and cfused.get_num_threads() == 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_counts_name_the_field(bad):
    with pytest.raises(ValueError, match="num_threads"):
        threads.apply_thread_policy(bad)


def test_default_is_one_thread_when_openmp_spins(monkeypatch, restore_threads):
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert threads.default_num_threads() == 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    assert threads.apply_thread_policy(None).num_threads == 1


def test_default_uses_the_available_cpus_when_waits_are_passive(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    expected = min(threads.available_cpus(), threads.MAX_DEFAULT_THREADS)
    assert threads.apply_thread_policy(None).num_threads == expected
    assert torch.get_num_threads() == expected
