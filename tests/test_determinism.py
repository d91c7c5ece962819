"""trainer.deterministic: true gives run-to-run identical fits, on the fused kernels too (they reduce in a fixed
order, with no atomics: docs/kernels.md). On the CPU the fused path runs under the Triton interpreter."""

import pytest
import torch
from helpers import fast_first, tiny_fit, tiny_module

from mhc_lightning.callbacks.run_provenance import weights_digest
from mhc_lightning.kernels import fused, get_ops


@pytest.fixture(autouse=True)
def restore_deterministic_mode():
    """Lightning turns torch's deterministic mode on for deterministic=True and never back off: later tests in this
    process would run other kernels than the processes they compare with."""
    mode, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    yield
    torch.use_deterministic_algorithms(mode, warn_only=warn_only)


@fast_first("backend", ["torch", pytest.param("triton", marks=pytest.mark.slow)])
def test_two_deterministic_fits_are_bitwise_identical(tiny_corpus, monkeypatch, backend):
    calls = []
    if backend == "triton":
        assert get_ops("triton", torch.device("cpu")) is fused
        real = fused.mhc_enter
        monkeypatch.setattr(fused, "mhc_enter", lambda *a, **k: calls.append(1) or real(*a, **k))
    states = []
    for _ in range(2):
        module = tiny_module("mhc", n_layers=1, diagnostics_every=2, kernel_backend=backend)
        _, module = tiny_fit(tiny_corpus, [], steps=3, module=module, deterministic=True, gradient_clip_val=1.0)
        states.append((module.state_dict(), weights_digest(module)))
    assert calls or backend == "torch"  # the fused ops ran
    (a, digest_a), (b, digest_b) = states
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert digest_a == digest_b
    first = tiny_module("mhc", n_layers=1, kernel_backend=backend)
    assert weights_digest(first) != digest_a  # training moved the weights the digest reads
