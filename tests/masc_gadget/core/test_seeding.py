"""isolated_rng: seeded blocks repeat, and no generator the caller holds moves."""

import pytest
import torch

from masc_gadget.core.seeding import isolated_rng


def test_a_seeded_block_repeats_and_leaves_the_global_generator_alone():
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    with isolated_rng(7):
        first = torch.rand(4)
    assert torch.equal(torch.random.get_rng_state(), before)
    with isolated_rng(7):
        assert torch.equal(torch.rand(4), first)
    with isolated_rng():
        torch.rand(100)  # a throw-away init
    assert torch.equal(torch.random.get_rng_state(), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeding_never_leaks_into_the_cuda_generators():
    torch.cuda.init()
    before = torch.cuda.get_rng_state_all()
    with isolated_rng(7):
        torch.rand(4, device="cuda")
    after = torch.cuda.get_rng_state_all()
    assert all(torch.equal(a, b) for a, b in zip(before, after))
