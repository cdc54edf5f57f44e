"""ls_adam's flat all-reduce under fairseq's legacy DDP wrapper, with two gloo processes on the CPU."""

import torch
import torch.distributed as dist

from _models import save_rank_result, two_rank_results


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 3))


def _loss(model, rank):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(7, 5, generator=g)
    return model(x).pow(2).sum() * (rank + 1)


def _worker(rank, port, out_dir):
    import ls_fairseq.fairseq_ext  # noqa: F401
    from fairseq.distributed import ModuleProxyWrapper
    from fairseq.distributed.legacy_distributed_data_parallel import LegacyDistributedDataParallel

    from ls_fairseq.fairseq_ext.optimizer import LSAdamConfig, LSFairseqAdam

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        model = _model()
        wrapped = ModuleProxyWrapper(LegacyDistributedDataParallel(model, process_group=dist.group.WORLD))
        opt = LSFairseqAdam(LSAdamConfig(lr=[0.1], adam_betas="(0.9, 0.98)"), list(model.parameters()))
        results = {}
        # --update-freq: inside no_sync the reduction waits, gradients stay local
        opt.zero_grad()
        with wrapped.no_sync():
            _loss(wrapped, rank).backward()
            opt.all_reduce_grads(wrapped)
            results["local"] = [p.grad.clone() for p in model.parameters()]
        # the reduction: every rank ends with the average of both ranks' gradients
        opt.all_reduce_grads(wrapped)
        results["reduced"] = [p.grad.clone() for p in model.parameters()]
        opt.step()
        results["params"] = [p.detach().clone() for p in model.parameters()]
        save_rank_result(out_dir, rank, results)
    finally:
        dist.destroy_process_group()


def test_flat_all_reduce_averages_gradients_like_fairseqs_legacy_ddp(tmp_path):
    got = two_rank_results(_worker, tmp_path)
    expected_local = []
    for rank in (0, 1):
        model = _model()
        _loss(model, rank).backward()
        expected_local.append([p.grad.clone() for p in model.parameters()])
    for rank in (0, 1):
        for a, b in zip(got[rank]["local"], expected_local[rank]):
            torch.testing.assert_close(a, b)
    for rank in (0, 1):
        for a, b0, b1 in zip(got[rank]["reduced"], *expected_local):
            torch.testing.assert_close(a, (b0 + b1) / 2)
    for a, b in zip(got[0]["params"], got[1]["params"]):
        assert torch.equal(a, b)  # the replicas stay identical


def test_other_wrappers_are_left_to_fairseq():
    from ls_fairseq.fairseq_ext.optimizer import _legacy_ddp

    model = _model()
    assert _legacy_ddp(model) is None
    assert _legacy_ddp(torch.nn.Sequential(model)) is None
