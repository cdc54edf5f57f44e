import pytest
import torch

from ls_fairseq.fairseq_ext.step.sample_prep import pin_sample

pytestmark = pytest.mark.gpu


def test_pin_sample_pins_cpu_tensors_and_keeps_the_rest():
    sample = {"net_input": {"src_tokens": torch.ones(2, 3, dtype=torch.long)}, "ntokens": 6, "id": torch.arange(2)}
    pinned = pin_sample(sample)
    assert pinned["ntokens"] == 6 and pinned["net_input"]["src_tokens"].is_pinned() and pinned["id"].is_pinned()
    assert torch.equal(pinned["id"], sample["id"])
    on_gpu = {"x": torch.ones(2, device="cuda")}
    assert pin_sample(on_gpu)["x"] is on_gpu["x"]


def test_per_update_seed_leaves_fairseqs_generator_state_on_every_gpu():
    """With CUDA initialised, seed_generators seeds the CPU and every CUDA device's generator
    directly (no fallback to fairseq's call): the states equal those fairseq's set_torch_seed leaves."""
    from fairseq import utils

    from ls_fairseq.fairseq_ext.step import trainer as tr

    torch.zeros(1, device="cuda")  # CUDA initialised, as in training
    assert torch.cuda.is_initialized()
    calls = []
    real = utils.set_torch_seed
    try:
        utils.set_torch_seed = lambda s: calls.append(s)
        for seed in (2, 777):
            torch.manual_seed(31)
            tr.seed_generators(seed)
            got = [torch.get_rng_state()] + [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
            draw = torch.rand(5, device="cuda")
            real(seed)
            want = [torch.get_rng_state()] + [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]
            for a, b in zip(got, want):
                assert torch.equal(a, b)
            assert torch.equal(draw, torch.rand(5, device="cuda"))
    finally:
        utils.set_torch_seed = real
    assert calls == []  # the direct path was taken
