"""The arithmetic of the CUDA-graph step, without graphs: a batch grown to its bucket, the model's body (what
the graphs hold), the head (eager) and the two backwards. :mod:`ls_fairseq.fairseq_ext.graph.graph_step` captures
and replays the body; :func:`split_step` runs the same on any device (the tests check it on the CPU).

Two kinds of bucket: padded (:class:`~ls_fairseq.fairseq_ext.graph.shape_buckets.Bucket`, sentences padded to fixed
lengths) and packed (:class:`~ls_fairseq.fairseq_ext.graph.packed_buckets.PackedBucket`, the real tokens back to back,
grown to fixed row counts). Either way the loss, the gradients and the logged statistics are those of the batch
as fairseq made it (padding is ignored by the masks and the loss, or never computed)."""

import torch

from ls_fairseq.fairseq_ext.graph.packed_buckets import PackedBucket
from ls_fairseq.fairseq_ext.packing import pack_batch, pad_packing
from ls_fairseq.fairseq_ext.graph.shape_buckets import Bucket, pad_batch

# the packing's device tensors, in the order the graph step uploads them (cu_* travel as int64)
PACKED_KEYS = ("src_tokens", "src_positions", "cu_src", "tgt_tokens", "tgt_positions", "cu_tgt")


def body(model, src_tokens, src_lengths, prev_output_tokens):
    """Encoder and decoder up to the decoder's features [B, T, C] (what the graphs hold)."""
    enc = model.encoder(src_tokens, src_lengths=src_lengths, src_has_padding=True)
    x, _ = model.decoder.extract_features(prev_output_tokens, enc)
    return x


def body_packed(model, packed, max_len: int):
    """Encoder and decoder over a packing (the tensors of PACKED_KEYS; sentences of at most ``max_len``
    tokens): the decoder's features of every packed target row [1, rows, C]."""
    p = {k: packed[k] for k in PACKED_KEYS}
    p["cu_src"], p["cu_tgt"] = p["cu_src"].int(), p["cu_tgt"].int()
    p["max_src"] = p["max_tgt"] = int(max_len)
    enc = model.encoder(p["src_tokens"], packed=p)
    x, _ = model.decoder.extract_packed_features(p, enc, every_row=True)
    return x


def head(model, criterion, features, rows, target_rows):
    """(loss, nll_loss) of the counted positions ``rows`` of ``features`` [..., C], computed as
    ls_label_smoothed_cross_entropy computes them from the full model."""
    from ls_fairseq.ops import label_smoothed_cross_entropy

    x = features.reshape(-1, features.shape[-1]).index_select(0, rows)
    logits = model.decoder.output_layer(x)
    return label_smoothed_cross_entropy(logits, target_rows, criterion.eps, ignore_index=criterion.padding_idx)


def head_step(model, criterion, features, rows, target_rows, optimizer, grad_out=None, first_writer=False):
    """The head's forward and backward: (loss, nll_loss, the features' gradient) of the counted positions
    ``rows`` of ``features`` [..., C] (a leaf), the output projection's gradient added into its ``.grad``.
    ``grad_out`` (optional, shaped as ``features``): where the features' gradient is written.
    ``first_writer``: the projection's ``.grad`` holds zeros that nothing else adds to before this head runs (the
    CUDA-graph step's updates of one micro-batch), so its FP8 weight-gradient GEMM may write there directly.

    With the trainer's deferred step (``optimizer.backward_by``) and the projection's gradient attached,
    without autograd: the cross-entropy kernel writes the gradient of the scaled loss over the logits in
    the pass that computes the loss (the logits are read once; under --fp8 it writes the gradient's FP8 codes
    instead, :func:`~ls_fairseq.ops.fp8.fp8_head_loss_backward`), and the two GEMMs of the projection's
    backward add into its gradient and write the features' rows. Otherwise :func:`head` and
    ``optimizer.backward(loss)``."""
    w = model.decoder.output_projection.weight
    if not hasattr(optimizer, "backward_by") or w.grad is None or not w.requires_grad:
        loss, nll = head(model, criterion, features, rows, target_rows)
        optimizer.backward(loss)
        if grad_out is None:
            return loss, nll, features.grad
        grad_out.copy_(features.grad)
        return loss, nll, grad_out
    from ls_fairseq.ops.cross_entropy import label_smoothed_cross_entropy_with_grad
    from ls_fairseq.ops.fp8 import fp8_head_forward, fp8_head_loss_backward, fp8_now

    C = features.shape[-1]
    # --fp8: the projection's three GEMMs in FP8 (attach_fp8 gives it no FP8 slot unless its sizes allow them)
    fp8 = fp8_now(model.decoder.output_projection)
    with torch.no_grad():
        x = features.reshape(-1, C).index_select(0, rows)
        if fp8 is None:
            logits = torch.mm(x, w.t())
        else:
            logits, saved = fp8_head_forward(x, w, fp8)

        def backward(scale):
            g = torch.zeros_like(features) if grad_out is None else grad_out.zero_()
            # (rows repeats row 0 for the ignored targets that round its count up: their gradient rows are zeros)
            if fp8 is None:
                loss, nll = label_smoothed_cross_entropy_with_grad(logits, target_rows, criterion.eps,
                                                                   criterion.padding_idx, scale)
                # logits now hold d(scale * loss) / d logits
                g.view(-1, C).index_add_(0, rows, torch.mm(logits, w))
                w.grad.addmm_(logits.t(), x)
            else:
                dw_out = w.grad if first_writer and _writable(w.grad, logits.dtype) else None
                loss, nll, dx, dw = fp8_head_loss_backward(logits, target_rows, criterion.eps, criterion.padding_idx,
                                                           scale, saved, fp8, dw_out=dw_out)
                g.view(-1, C).index_add_(0, rows, dx)
                if dw_out is None:
                    w.grad.add_(dw)
            return loss, nll, g

        return optimizer.backward_by(backward)


def _writable(t, dtype) -> bool:
    """Whether a GEMM may write its output into ``t`` (contiguous, of ``dtype``, 16-byte aligned)."""
    return t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 16 == 0


class _PlainBackward:
    @staticmethod
    def backward(loss):
        loss.backward()


def logging_output(criterion, loss, nll_loss, ntokens, nsentences):
    sample_size = nsentences if criterion.sentence_avg else ntokens
    return sample_size, {"loss": loss.data, "nll_loss": nll_loss.data, "ntokens": ntokens,
                         "nsentences": nsentences, "sample_size": sample_size}


def padded_inputs(sample, bucket: Bucket, criterion, pad: int, eos: int, left_pad_source: bool):
    """The host tensors of ``sample`` padded to ``bucket``: (src_tokens, src_lengths,
    prev_output_tokens, rows, target_rows), rows indexing the flattened padded target."""
    net = sample["net_input"]
    src, lengths, prev, tgt = pad_batch(net["src_tokens"], net["prev_output_tokens"], sample["target"], bucket,
                                        pad, eos, left_pad_source)
    rows = criterion.counted_rows(tgt)
    return src, lengths, prev, rows, tgt.reshape(-1).index_select(0, rows)


def pack_sample(sample, criterion, pad: int):
    """(the packing of ``sample`` (host tensors), the targets of its counted rows), or None when the batch
    cannot be packed (:func:`~ls_fairseq.fairseq_ext.packing.pack_batch`)."""
    net, tgt = sample["net_input"], sample["target"]
    rows = criterion.counted_rows(tgt)
    packed = pack_batch(net["src_tokens"], net["prev_output_tokens"], tgt, rows, pad)
    if packed is None:
        return None
    return packed, tgt.reshape(-1).index_select(0, rows)


def packing_shape(packed):
    """(sentences, source tokens, target tokens, longest sentence) of a packing, as the buckets take it."""
    return (packed["cu_src"].numel() - 1, packed["src_tokens"].shape[1], packed["tgt_tokens"].shape[1],
            max(int(packed["max_src"]), int(packed["max_tgt"])))


def packed_inputs(packed, bucket: PackedBucket, pad: int):
    """A packing grown to ``bucket`` (host tensors), its offsets int64."""
    p = pad_packing(packed, bucket.src_rows, bucket.tgt_rows, bucket.sentences, pad, max_len=bucket.max_len)
    p["cu_src"], p["cu_tgt"] = p["cu_src"].long(), p["cu_tgt"].long()
    return p


def split_step(model, criterion, sample, bucket, pad: int, eos: int, left_pad_source: bool = True,
               optimizer=None):
    """The graph step's arithmetic without graphs (any device): body, head, backward through the
    head into the features, backward through the body. Returns (loss, sample_size, logging output).
    ``optimizer`` (optional): the task's view of the optimizer, whose ``backward(loss)`` (or ``backward_by``)
    applies the trainer's loss scaling (:func:`head_step`); without it, ``loss.backward()``."""
    if optimizer is None:
        optimizer = _PlainBackward()
    dev = next(model.parameters()).device
    if isinstance(bucket, PackedBucket):
        packed, target_rows = pack_sample(sample, criterion, pad)
        p = {k: v.to(dev) if torch.is_tensor(v) else v for k, v in packed_inputs(packed, bucket, pad).items()}
        rows, target_rows = p["rows"], target_rows.to(dev)
        feats = body_packed(model, p, bucket.max_len)
    else:
        src, lengths, prev, rows, target_rows = (t.to(dev) for t in padded_inputs(
            sample, bucket, criterion, pad, eos, left_pad_source))
        feats = body(model, src, lengths, prev)
    leaf = feats.detach().requires_grad_(True)
    loss, nll, grad = head_step(model, criterion, leaf, rows, target_rows, optimizer)
    torch.autograd.backward(feats, grad)
    sample_size, log = logging_output(criterion, loss, nll, sample["ntokens"], sample["target"].size(0))
    return loss, sample_size, log
