"""lightseq-convert: switch a fairseq checkpoint between the native and the ls_fairseq architecture.

    lightseq-convert checkpoints/checkpoint_best.pt native.pt --to native   # ls_transformer_X -> transformer_X
    lightseq-convert native.pt ls.pt --to ls                                # transformer_X -> ls_transformer_X

The weights are not touched: ls_transformer keeps fairseq's native parameter names and shapes. What
changes is the configuration stored in the checkpoint: the architecture (``arch`` / ``_name``), the
criterion (ls_label_smoothed_cross_entropy <-> label_smoothed_cross_entropy), the optimizer
(ls_adam <-> adam) and, for --to native, the stored --user-dir, so plain ``fairseq-generate`` loads the
result without ls_fairseq. The optimizer state is dropped (the two optimizers keep different state);
continue training a converted checkpoint with --reset-optimizer.
"""

import argparse
import logging
import os
import sys
from argparse import Namespace
from typing import Any, Dict, List, Optional

logger = logging.getLogger("ls_fairseq.cli.convert")

LS_PREFIX = "ls_"
# name in a native checkpoint -> name in an ls checkpoint (besides the model architecture)
RENAMES = {
    "label_smoothed_cross_entropy": "ls_label_smoothed_cross_entropy",
    "adam": "ls_adam",
    "LabelSmoothedCrossEntropyCriterion": "LSLabelSmoothedCrossEntropyCriterion",
}


def _convert_arch(name: str, to: str) -> str:
    if to == "native":
        if not name.startswith(LS_PREFIX + "transformer"):
            raise ValueError(f"architecture '{name}' is not an ls_transformer architecture")
        return name[len(LS_PREFIX):]
    if not name.startswith("transformer"):
        raise ValueError(f"architecture '{name}' is not a native transformer architecture")
    return LS_PREFIX + name


def _convert_name(name, to: str):
    if not isinstance(name, str):
        return name
    if to == "ls":
        return RENAMES.get(name, name)
    back = {v: k for k, v in RENAMES.items()}
    return back.get(name, name)


def _check_arch_registered(arch: str, to: str):
    from fairseq.models import ARCH_MODEL_REGISTRY

    if to == "ls":
        import ls_fairseq.fairseq_ext  # noqa: F401  (registers the ls_transformer archs)
    if arch not in ARCH_MODEL_REGISTRY:
        raise ValueError(f"no architecture '{arch}' is registered: cannot convert to it")


def _get(obj, key, default=None):
    if isinstance(obj, dict):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _set(obj, key, value):
    if isinstance(obj, dict):
        obj[key] = value
    else:
        setattr(obj, key, value)


def _has(obj, key) -> bool:
    return key in obj if isinstance(obj, dict) else hasattr(obj, key)


def _convert_model_cfg(model_cfg, to: str) -> Optional[str]:
    """Rewrite arch/_name of a model config (dict or Namespace) in place; return the new arch."""
    new = None
    for key in ("arch", "_name"):
        value = _get(model_cfg, key)
        if isinstance(value, str):
            new = _convert_arch(value, to)
            _set(model_cfg, key, new)
    # a Namespace model cfg also carries the flat training args
    for key in ("criterion", "optimizer"):
        if isinstance(_get(model_cfg, key), str):
            _set(model_cfg, key, _convert_name(_get(model_cfg, key), to))
    if to == "native" and _has(model_cfg, "user_dir"):
        _set(model_cfg, "user_dir", None)
    return new


def convert_state(state: Dict[str, Any], to: str) -> List[str]:
    """Convert a loaded checkpoint dict in place. Returns a list of what changed, for the log."""
    if to not in ("native", "ls"):
        raise ValueError(f"--to must be 'native' or 'ls', got '{to}'")
    if "model" not in state:
        raise ValueError("not a fairseq checkpoint: no 'model' entry")
    changed, arch = [], None
    cfg = state.get("cfg")
    if cfg is not None:
        if _get(cfg, "model") is not None:
            arch = _convert_model_cfg(_get(cfg, "model"), to)
        for section in ("criterion", "optimizer"):
            sub = _get(cfg, section)
            if sub is not None and isinstance(_get(sub, "_name"), str):
                _set(sub, "_name", _convert_name(_get(sub, "_name"), to))
        common = _get(cfg, "common")
        if to == "native" and common is not None and _has(common, "user_dir"):
            _set(common, "user_dir", None)
    if isinstance(state.get("args"), Namespace):
        arch = _convert_model_cfg(state["args"], to) or arch
    if arch is None:
        raise ValueError("the checkpoint stores no model architecture (neither cfg.model nor args)")
    _check_arch_registered(arch, to)
    changed.append(f"arch -> {arch}")
    for hist in state.get("optimizer_history") or []:
        for key in ("criterion_name", "optimizer_name"):
            if key in hist:
                hist[key] = _convert_name(hist[key], to)
    if state.get("last_optimizer_state") is not None:
        state["last_optimizer_state"] = None
        changed.append("optimizer state dropped (continue training with --reset-optimizer)")
    return changed


def convert_file(src: str, dst: str, to: str) -> List[str]:
    import torch

    from ls_fairseq.fairseq_ext.checkpoint_files import load_state_checked

    state = load_state_checked(src, lambda path: torch.load(path, map_location="cpu", weights_only=False))
    changed = convert_state(state, to)
    os.makedirs(os.path.dirname(os.path.abspath(dst)), exist_ok=True)
    torch.save(state, dst)
    return changed


def cli_main(argv: Optional[List[str]] = None) -> int:
    logging.basicConfig(format="%(asctime)s | %(levelname)s | %(name)s | %(message)s", level=logging.INFO,
                        stream=sys.stdout)
    p = argparse.ArgumentParser(prog="lightseq-convert", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("input", help="fairseq checkpoint (.pt)")
    p.add_argument("output", help="where to write the converted checkpoint")
    p.add_argument("--to", required=True, choices=["native", "ls"],
                   help="native: loads in plain fairseq; ls: loads as ls_transformer")
    a = p.parse_args(argv)
    if os.path.abspath(a.input) == os.path.abspath(a.output):
        p.error("output must differ from input")
    try:
        changed = convert_file(a.input, a.output, a.to)
    except (ValueError, FileNotFoundError) as e:
        p.exit(1, f"lightseq-convert: error: {e}\n")
    logger.info(f"{a.input} -> {a.output}: {'; '.join(changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(cli_main())
