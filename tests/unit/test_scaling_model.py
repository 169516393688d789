"""The ring-allreduce + fusion cost model (benchmarks/scaling_model.py)."""

import importlib.util
import os

import pytest

from tests.support.helpers import REPO_ROOT


def _load():
    path = os.path.join(REPO_ROOT, "benchmarks", "scaling_model.py")
    spec = importlib.util.spec_from_file_location("scaling_model", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


sm = _load()
NET = sm.Network("test", alpha=10e-6, beta=1e-9)  # 1 GB/s


def test_ring_allreduce_formula():
    assert sm.ring_allreduce_s(1e6, 1, NET) == 0.0
    # n=2: 2 alpha + S beta
    assert sm.ring_allreduce_s(1e6, 2, NET) == pytest.approx(20e-6 + 1e-3)
    # n=4: 6 alpha + 1.5 S beta
    assert sm.ring_allreduce_s(1e6, 4, NET) == pytest.approx(60e-6 + 1.5e-3)


def test_fusion_buffers():
    assert sm.fusion_buffers(10, 5, 25) == [(20, 2), (20, 2), (10, 1)]
    assert sm.fusion_buffers(10, 3, 1e9) == [(30, 3)]
    # fusion off (threshold 0): one tensor per buffer, even oversize ones
    assert sm.fusion_buffers(10, 3, 0) == [(10, 1)] * 3


def test_fit_recovers_alpha_beta():
    sizes = [4096, 65536, 2**20, 16 * 2**20]
    for n in (2, 4):
        times = [sm.ring_allreduce_s(s, n, NET) for s in sizes]
        alpha, beta = sm.fit_alpha_beta(sizes, times, n)
        assert alpha == pytest.approx(NET.alpha, rel=1e-6)
        assert beta == pytest.approx(NET.beta, rel=1e-6)
    with pytest.raises(ValueError):
        sm.fit_alpha_beta([1], [1.0], 2)


def test_step_time_exact_small_case():
    # 1 s compute, backward = last 2/3, 2 tensors of 0.5 MB, no fusion:
    # tensor 1 ready at 1/3 + 1/3, tensor 2 at 1; each takes 2a + S b on
    # n=2 = 20 us + 0.5 ms; the last ends 0.52 ms after the compute.
    work = sm.Workload("w", params=250e3, tensors=2, img_per_s=64.0)
    rt = sm.Runtime("r", fusion_bytes=0)
    assert sm.step_time_s(work, 2, NET, rt) == pytest.approx(1.00052)
    assert sm.efficiency(work, 1, NET, rt) == 1.0
    # A 1 ms cycle wait and 10 us per tensor add to the tail.
    rt = sm.Runtime("r", fusion_bytes=0, per_tensor_s=10e-6, cycle_s=1e-3)
    assert sm.step_time_s(work, 2, NET, rt) == pytest.approx(1.00153)


def test_paper_setting_close_to_paper():
    rows = {w.name: (tcp, rdma) for w, tcp, rdma, _ in sm.paper_table()}
    # Horovod paper: ~88% for Inception V3 and ResNet-101 at 128 GPUs.
    for name in ("Inception V3", "ResNet-101"):
        assert 0.83 <= rows[name][0] <= 0.95, rows
    # VGG-16 (554 MB of gradients) much lower on TCP; RDMA helps it most.
    tcp, rdma = rows["VGG-16"]
    assert tcp < 0.7 and rdma > tcp * 1.15
    assert rows["Inception V3"][1] - rows["Inception V3"][0] < 0.05


def test_efficiency_falls_with_ranks_and_per_tensor_cost():
    table = sm.prediction_table(5e-6)
    for effs in table.values():
        assert all(0 < e <= 1 for e in effs)
        assert all(a >= b - 1e-12 for a, b in zip(effs, effs[1:]))
    vgg = sm.PAPER_WORKLOADS[2]
    cheap = sm.efficiency(vgg, 64, sm.TCP_25G, sm.kerasdist_runtime(1e-6))
    dear = sm.efficiency(vgg, 64, sm.TCP_25G, sm.kerasdist_runtime(1e-3))
    assert dear < cheap


def test_cli_prints_tables(capsys):
    assert sm.main([]) == 0
    out = capsys.readouterr().out
    assert "Horovod paper setting" in out and "1024" in out
