"""Megatron-LM's file-based tokenizers, offline: a byte-level BPE trained on the standard
library by scripts/preprocess_data.py, read back as GPT2BPETokenizer (vocab.json, merges.txt)
and HuggingFaceTokenizer (a folder), and a TP=2 model trained on the data it tokenized."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
from megatron.hetero.data import build_tokenizer
from megatron.hetero.text_tokenizers import TokenizerFileError
from tests.utils import MHA, ROOT, run_ranks, train


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    """300 kB of the standard library, a 512-entry BPE trained on it, and the indexed dataset
    it tokenized."""
    folder = tmp_path_factory.mktemp("bpe")
    out = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "scripts", "preprocess_data.py"),
            "--stdlib",
            "--max-bytes",
            "300000",
            "--output-prefix",
            str(folder / "stdlib"),
            "--train-bpe",
            "512",
            "--train-bpe-dir",
            str(folder / "tokenizer"),
            "--append-eod",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "GPT2BPETokenizer" in out.stdout
    return folder


def test_a_trained_bpe_reads_back_as_both_tokenizers(bpe):
    tokenizer_dir = bpe / "tokenizer"
    gpt2 = build_tokenizer(
        "GPT2BPETokenizer",
        vocab_file=str(tokenizer_dir / "vocab.json"),
        merge_file=str(tokenizer_dir / "merges.txt"),
    )
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tokenizer_dir))
    text = 'def f(x):\n    return {"ünï": x}  # code\n'
    ids = gpt2.tokenize(text)
    assert ids == hf.tokenize(text) and len(ids) < len(text.encode())  # merges apply
    assert gpt2.detokenize(ids) == text == hf.detokenize(ids)
    assert gpt2.vocab_size == hf.vocab_size == 512
    vocab = json.loads((tokenizer_dir / "vocab.json").read_text())
    assert gpt2.eod == hf.eod == vocab["<|endoftext|>"]


def test_tokenizer_files_are_checked_by_name(bpe, tmp_path):
    def args(extra):
        parsed = build_parser().parse_args(
            (MHA + " --tensor-model-parallel-size 1 " + extra).split()
        )
        validate_args(parsed, 1, cuda_available=False)

    with pytest.raises(ArgumentError, match="needs --merge-file"):
        args(f"--tokenizer-type GPT2BPETokenizer --vocab-file {bpe}/tokenizer/vocab.json")
    with pytest.raises(ArgumentError, match="needs --tokenizer-model: a local folder"):
        args(f"--tokenizer-type HuggingFaceTokenizer --tokenizer-model {tmp_path}")
    with pytest.raises(ArgumentError, match="without --tokenizer-type"):
        args(f"--vocab-file {bpe}/tokenizer/vocab.json")
    broken = tmp_path / "vocab.json"
    broken.write_text("{not json")
    with pytest.raises(TokenizerFileError, match="--vocab-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=str(broken), merge_file=str(broken))


def test_a_tp2_model_learns_from_the_bpe_corpus_with_either_tokenizer(bpe):
    data = str(bpe / "stdlib_text_document")
    base = (
        MHA.replace("--mock-data --vocab-size 255", f"--data-path {data} --split 90,10,0")
        .replace("--train-iters 1", "--train-iters 30")
        .replace("--lr 1e-3", "--lr 3e-3")
        + " --tensor-model-parallel-size 2 --global-batch-size 8 --eval-iters 0 --het-tp"
    ).split()
    gpt2 = base + [
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        str(bpe / "tokenizer" / "vocab.json"),
        "--merge-file",
        str(bpe / "tokenizer" / "merges.txt"),
    ]
    hf = base + [
        "--tokenizer-type",
        "HuggingFaceTokenizer",
        "--tokenizer-model",
        str(bpe / "tokenizer"),
    ]
    first = run_ranks(train, 2, gpt2)[0]["losses"]
    second = run_ranks(train, 2, hf)[0]["losses"]
    assert first == second  # the same ids and vocabulary
    early = sum(first[i] for i in range(1, 6)) / 5
    late = sum(first[i] for i in range(26, 31)) / 5
    assert late < early - 0.5, (early, late)
