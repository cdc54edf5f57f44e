"""Kernel timelines of torch.profiler, shared by the profiling scripts."""


def covered_time(spans):
    """Length of the union of (start, end) intervals: the time at least one of them was running."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total
