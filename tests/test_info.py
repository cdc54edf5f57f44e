"""python -m ls_fairseq.info: content of the report, and no CUDA / fairseq at import time."""

import subprocess
import sys

from ls_fairseq import _ext
from ls_fairseq.ops import _dispatch


def test_report_names_versions_extension_and_every_op():
    import torch

    from ls_fairseq import info

    text = info.report()
    assert f"torch: {torch.__version__}" in text
    assert "fairseq: fairseq-fixed 0.12.3.1" in text
    if _ext.get() is None:
        assert f"ls_fairseq._C: not loaded ({_ext.reason()})" in text
    else:
        assert f"ls_fairseq._C: loaded ({_ext.source()}" in text
    lines = text.splitlines()
    for op in _dispatch.KERNEL_ENTRY:
        matching = [line for line in lines if line.split()[:1] == [op]]
        assert len(matching) == 1, op
        assert _dispatch.explain(op) in matching[0]
    assert f"autograd (eager, CUDA tensors): {_dispatch.explain_autograd()}" in lines


def test_explain_autograd_follows_the_setting(monkeypatch):
    class WithNodes:
        ag_linear = None

    # each swap of the module starts with an empty cache of what it exports, as _ext.reset_for_tests() leaves it
    monkeypatch.setattr(_dispatch, "_HAS_ENTRY", {})
    monkeypatch.setattr(_ext, "get", lambda: WithNodes)
    for flags, words in (((True, True), "C++ nodes for the fused ops and the projections"),
                         ((True, False), "C++ nodes for the fused ops, F.linear for the projections"),
                         ((False, False), "Python autograd.Functions and F.linear")):
        monkeypatch.setattr(_dispatch, "_CPP_AUTOGRAD", flags[0])
        monkeypatch.setattr(_dispatch, "_CPP_LINEAR", flags[1])
        assert _dispatch.explain_autograd().split(";")[0] == words
    monkeypatch.setattr(_dispatch, "_CPP_LINEAR", True)
    monkeypatch.setattr(_dispatch, "_CPP_AUTOGRAD", True)
    assert "this extension build has no C++ layers" in _dispatch.explain_autograd()

    class WithLayers(WithNodes):
        encoder_layer_fwd = decoder_layer_fwd = None

    monkeypatch.setattr(_dispatch, "_HAS_ENTRY", {})
    monkeypatch.setattr(_ext, "get", lambda: WithLayers)
    for flag, word in ((True, "each encoder / decoder layer one C++ call"), (False, "layers in Python")):
        monkeypatch.setattr(_dispatch, "_CPP_LAYERS", flag)
        assert _dispatch.explain_autograd().endswith(word)
    monkeypatch.setattr(_dispatch, "_HAS_ENTRY", {})
    monkeypatch.setattr(_ext, "get", lambda: object())
    assert "no C++ nodes" in _dispatch.explain_autograd()
    monkeypatch.setattr(_ext, "get", lambda: None)
    assert "unavailable" in _dispatch.explain_autograd()


def test_report_on_this_machine_says_why_kernels_are_off():
    import torch

    from ls_fairseq import info

    if torch.version.cuda is None:
        text = info.report()
        assert "CPU-only build" in text
        assert "reference (extension unavailable" in text


def test_import_touches_neither_cuda_nor_fairseq_and_main_runs():
    code = (
        "import sys\n"
        "import ls_fairseq.info\n"
        "assert 'torch' not in sys.modules, 'torch imported at import time'\n"
        "assert 'fairseq' not in sys.modules, 'fairseq imported at import time'\n"
        "ls_fairseq.info.main()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ls_fairseq: ")
    assert "ops (path on CUDA tensors" in out.stdout
    out = subprocess.run([sys.executable, "-m", "ls_fairseq.info"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and "attention" in out.stdout
