"""--max-tokens too small for the data, and raw text (--dataset-impl raw) that is not UTF-8: errors naming the
flag, or the file and line, in fairseq's own commands (through the install_* patches) and lightseq-generate."""

import os

import pytest

from ls_fairseq.fairseq_ext import data_checks
from ls_fairseq.fairseq_ext.data_checks import DataError
from tests._models import fairseq_main, fairseq_run

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_flags(data, save, max_tokens, *extra):
    return [data, "--user-dir", os.path.join(ROOT, "user_dir"), "--arch", "ls_transformer_tiny", "--optimizer",
            "adam", "--lr", "1e-3", "--max-tokens", str(max_tokens), "--max-update", "1", "--cpu", "--num-workers",
            "0", "--save-dir", str(save), "--no-save", *extra]


@pytest.mark.parametrize("max_tokens,match", [
    (0, r"--max-tokens must be a positive number of tokens per batch, got 0"),
    (3, r"--max-tokens 3 is smaller than every sentence of the train split: the shortest has \d+ tokens"),
])
def test_fairseq_train_max_tokens_no_sentence_fits(data_bin, tmp_path, max_tokens, match):
    data_checks.install_max_tokens_check()
    with pytest.raises(DataError, match=match):
        fairseq_main("train", _train_flags(data_bin, tmp_path, max_tokens, "--skip-invalid-size-inputs-valid-test"))


def test_check_max_tokens_for_training(data_bin):
    """The function a training entry point calls with its cfg and task, once the train split is loaded."""
    from fairseq import options, tasks
    from fairseq.dataclass.utils import convert_namespace_to_omegaconf

    def cfg_for(max_tokens):
        parser = options.get_training_parser()
        args = options.parse_args_and_arch(parser, [data_bin, "--arch", "transformer_tiny", "--max-tokens",
                                                    str(max_tokens), "--cpu"])
        return convert_namespace_to_omegaconf(args)

    cfg = cfg_for(3)
    task = tasks.setup_task(cfg.task)
    task.load_dataset("train")
    with pytest.raises(DataError, match=r"--max-tokens 3 is smaller than every sentence of the train split"):
        data_checks.check_max_tokens(cfg, task)
    data_checks.check_max_tokens(cfg_for(12), task)  # the longer sentences are dropped, the others train


def test_generate_max_tokens_smaller_than_a_sentence(tmp_path):
    """lightseq-generate (and fairseq-generate with the check): fairseq asserts deep in its batching."""
    from ls_fairseq.cli import generate

    ckpt = _tiny_checkpoint(tmp_path)
    flags = [ckpt["data"], "--path", ckpt["path"], "--cpu", "--num-workers", "0", "--max-tokens", "5",
             "--dataset-impl", "raw", "-s", "en", "-t", "de", "--results-path", str(tmp_path / "out")]
    with fairseq_run(), pytest.raises(SystemExit) as e:
        generate.cli_main(flags)
    msg = str(e.value.code)
    assert msg.startswith("lightseq-generate: error: --max-tokens 5 is smaller than sentence ") and \
        "of the test split" in msg and "raise --max-tokens to at least" in msg, msg
    data_checks.install_max_tokens_check()
    with pytest.raises(DataError, match=r"--max-tokens 5 is smaller than sentence \d+ of the test split"):
        fairseq_main("generate", flags)


# ----------------------------------------------------------------------------- raw text
def _raw_data(root, bad_split=None, bad_line=3):
    words = "the a house cat dog sees eats bread red car".split()
    for lang in ("en", "de"):
        (root / f"dict.{lang}.txt").write_text("".join(f"{w} 1\n" for w in words))
    for split, n in (("train", 40), ("valid", 8), ("test", 6)):
        for lang in ("en", "de"):
            lines = [" ".join(words[(i + j) % len(words)] for j in range(3 + i % 4)).encode() for i in range(n)]
            if split == bad_split and lang == "de":
                lines[bad_line - 1] = "caf\u00e9 red".encode("latin-1")  # a Latin-1 byte: not UTF-8
            (root / f"{split}.en-de.{lang}").write_bytes(b"".join(x + b"\n" for x in lines))
    return str(root)


def test_undecodable_line():
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".txt") as f:
        f.write(b"ok\nfine \xc3\xa9\nbad \xe9 here\n")
        f.flush()
        assert data_checks.undecodable_line(f.name) == (3, 4, "invalid continuation byte")
        f.seek(0)
        f.truncate()
        f.write(b"all\nutf-8 \xc3\xa9\n")
        f.flush()
        assert data_checks.undecodable_line(f.name) is None


def test_fairseq_train_raw_text_names_file_and_line(tmp_path):
    data = _raw_data(tmp_path, bad_split="train", bad_line=3)
    data_checks.install_raw_text_check()
    bad = os.path.join(data, "train.en-de.de")
    with pytest.raises(DataError, match=rf"^{bad}, line 3 \(byte 4 of the line\) is not UTF-8 text"):
        fairseq_main("train", _train_flags(data, tmp_path / "s", 512, "--dataset-impl", "raw", "-s", "en",
                                           "-t", "de"))


def test_lightseq_generate_raw_text_names_file_and_line(tmp_path):
    from ls_fairseq.cli import generate

    good = _tiny_checkpoint(tmp_path / "ckpt")
    data = _raw_data(tmp_path, bad_split="test", bad_line=2)
    with fairseq_run(), pytest.raises(SystemExit) as e:
        generate.cli_main([data, "--path", good["path"], "--cpu", "--dataset-impl", "raw", "-s", "en", "-t", "de",
                           "--max-tokens", "500", "--num-workers", "0"])
    assert str(e.value.code).startswith(
        f"lightseq-generate: error: {os.path.join(data, 'test.en-de.de')}, line 2 (byte 4 of the line) is not UTF-8")


def _tiny_checkpoint(root):
    """An ls_transformer_tiny checkpoint of one update on raw data (the dictionaries of :func:`_raw_data`)."""
    (root / "data").mkdir(parents=True)
    data = _raw_data(root / "data")
    fairseq_main("train", [data, "--user-dir", os.path.join(ROOT, "user_dir"), "--arch", "ls_transformer_tiny",
                           "--optimizer", "adam", "--lr", "1e-3", "--max-tokens", "500", "--max-update", "1",
                           "--cpu", "--num-workers", "0", "--save-dir", str(root / "save"), "--dataset-impl", "raw",
                           "-s", "en", "-t", "de", "--no-epoch-checkpoints", "--share-all-embeddings"])
    return {"data": data, "path": str(root / "save" / "checkpoint_last.pt")}
