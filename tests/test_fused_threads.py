"""The thread policy: apply_thread_policy sets torch's and the fused kernels' thread counts;
the default is one thread unless idle OpenMP threads wait passively."""
from __future__ import annotations

import pytest
import torch

from cext import cpu
from engine.models import threads


@pytest.fixture
def restore_threads():
    torch_threads, kernel_threads = torch.get_num_threads(), cpu.get_num_threads()
    yield
    torch.set_num_threads(torch_threads)
    cpu.set_num_threads(kernel_threads)


def test_explicit_count_sets_both_pools(restore_threads):
    policy = threads.apply_thread_policy(1)
    assert policy.num_threads == 1 and policy.num_kernel_threads == 1
    assert torch.get_num_threads() == 1 and cpu.get_num_threads() == 1
    policy = threads.apply_thread_policy(3)
    assert torch.get_num_threads() == 3 and cpu.get_num_threads() == 3


@pytest.mark.parametrize("bad", [0, -2, 1.5, "2", True])
def test_bad_counts_name_the_field(bad):
    with pytest.raises(ValueError, match="num_threads"):
        threads.apply_thread_policy(bad)


def test_default_is_one_torch_thread_when_openmp_spins(monkeypatch, restore_threads):
    """torch's team: one thread; the kernels' pool (no spinning barriers): every CPU."""
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    assert threads.default_num_threads() == 1
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    policy = threads.apply_thread_policy(None)
    assert policy.num_threads == 1 and torch.get_num_threads() == 1
    assert policy.num_kernel_threads == 2 and cpu.get_num_threads() == 2


def test_one_thread_by_import_order_is_said_once(monkeypatch, restore_threads, caplog):
    """torch loaded before engine with OMP_WAIT_POLICY unset: the default is one thread, and a
    warning names why and the fixes (once per process); a policy set on purpose says nothing."""
    monkeypatch.setattr(threads, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads, "_warned_one_thread", False)
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with caplog.at_level("WARNING", logger="engine.models.threads"):
        assert threads.apply_thread_policy(None).num_threads == 1
        threads.apply_thread_policy(None)
    said = [r.getMessage() for r in caplog.records if r.name == "engine.models.threads"]
    assert len(said) == 1 and "imported before engine" in said[0] and "num_threads" in said[0]
    assert "kernels' pool keeps 2" in said[0]
    caplog.clear()
    monkeypatch.setattr(threads, "_warned_one_thread", False)
    monkeypatch.setenv("OMP_WAIT_POLICY", "active")
    with caplog.at_level("WARNING", logger="engine.models.threads"):
        threads.apply_thread_policy(None)
    assert not [r for r in caplog.records if r.name == "engine.models.threads"]


def test_default_uses_the_available_cpus_when_waits_are_passive(monkeypatch, restore_threads):
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    expected = min(threads.available_cpus(), threads.MAX_DEFAULT_THREADS)
    assert threads.apply_thread_policy(None).num_threads == expected
    assert torch.get_num_threads() == expected


@pytest.mark.parametrize("spin_us", [0.0, 300.0])
def test_pool_results_do_not_depend_on_how_workers_wait(spin_us, restore_threads):
    """Workers that sleep at once (0) and workers that poll first split the same product
    the same way: the outputs match the single-thread call bit for bit."""
    from engine.models.linear import Linear
    from engine.models.quant import Int4Weight

    old_spin, old_threshold = cpu.get_spin_us(), cpu.get_parallel_threshold()
    torch.manual_seed(0)
    layer = Linear(Int4Weight.from_dense(torch.randn(256, 128) * 0.05))
    xs = [torch.randn(m, 128) for m in (1, 3, 16)]
    try:
        cpu.set_num_threads(1)
        expected = [layer(x) for x in xs]
        cpu.set_num_threads(2)
        cpu.set_parallel_threshold(0)
        cpu.set_spin_us(spin_us)
        for _ in range(20):  # back-to-back jobs: a polling worker catches most of them
            for x, want in zip(xs, expected):
                assert torch.equal(layer(x), want)
    finally:
        cpu.set_spin_us(old_spin)
        cpu.set_parallel_threshold(old_threshold)


@pytest.mark.parametrize("bad", [-1.0, float("nan")])
def test_bad_spin_is_a_value_error(bad):
    with pytest.raises(ValueError, match="spin_us"):
        cpu.set_spin_us(bad)


@pytest.mark.parametrize("num_threads", [1, 2])
@pytest.mark.parametrize("nbytes", [0, 7, 8, 13, 65536, 65536 * 3 + 40, 1 << 20])
def test_read_probe_reads_every_word_once(num_threads, nbytes, restore_threads):
    """cext.cpu.read_bytes (the read-bandwidth probe) returns the XOR of the buffer's 8-byte words,
    however the pool splits it: a word skipped or read twice changes the result."""
    import numpy as np

    old_threshold = cpu.get_parallel_threshold()
    words = np.random.default_rng(nbytes).integers(0, 2**63, size=(nbytes + 7) // 8 + 1, dtype=np.uint64)
    try:
        cpu.set_num_threads(num_threads)
        cpu.set_parallel_threshold(0)
        whole = nbytes // 8
        want = int(np.bitwise_xor.reduce(words[:whole])) if whole else 0
        assert cpu.read_bytes(words.ctypes.data, nbytes) == want
    finally:
        cpu.set_parallel_threshold(old_threshold)


def test_read_probe_rejects_a_negative_size():
    with pytest.raises(ValueError, match="nbytes"):
        cpu.read_bytes(0, -1)
