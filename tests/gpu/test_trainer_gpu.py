import pytest
import torch

from ls_fairseq.fairseq_ext.trainer import pin_sample

pytestmark = pytest.mark.gpu


def test_pin_sample_pins_cpu_tensors_and_keeps_the_rest():
    sample = {"net_input": {"src_tokens": torch.ones(2, 3, dtype=torch.long)}, "ntokens": 6, "id": torch.arange(2)}
    pinned = pin_sample(sample)
    assert pinned["ntokens"] == 6 and pinned["net_input"]["src_tokens"].is_pinned() and pinned["id"].is_pinned()
    assert torch.equal(pinned["id"], sample["id"])
    on_gpu = {"x": torch.ones(2, device="cuda")}
    assert pin_sample(on_gpu)["x"] is on_gpu["x"]
