"""Megatron-LM's file-based tokenizers, offline: a byte-level BPE trained on the standard
library by scripts/preprocess_data.py, read back as GPT2BPETokenizer (vocab.json, merges.txt),
HuggingFaceTokenizer (a folder) and TikTokenizer (tiktoken.json), a SentencePiece model trained
the same way, and TP=2 models trained on the data each tokenized."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
from megatron.hetero.data import build_tokenizer, tokenizer_from_args
from megatron.hetero.text_tokenizers import TokenizerFileError
from tests.utils import MHA, ROOT, run_ranks, train

NO_VOCAB = MHA.replace("--vocab-size 255", "")  # the tokenizer's files decide


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
    # their contents are read at start too, not after the process groups exist
    with pytest.raises(ArgumentError, match="--vocab-file"):
        args(f"--tokenizer-type GPT2BPETokenizer --vocab-file {broken} --merge-file {broken}")
    with pytest.raises(ArgumentError, match="--tokenizer-model"):  # not a SentencePiece model
        args(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {broken}")


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


@pytest.fixture(scope="module", params=["SentencePieceTokenizer", "TikTokenizer"])
def trained(request, tmp_path_factory):
    """150 kB of the standard library tokenized by a 512-entry tokenizer of the given type that
    preprocess_data.py trained on it first; the flags it prints for pretrain_gpt.py."""
    folder = tmp_path_factory.mktemp(request.param)
    command = [
        sys.executable,
        os.path.join(ROOT, "scripts", "preprocess_data.py"),
        "--stdlib",
        "--max-bytes",
        "150000",
        "--output-prefix",
        str(folder / "stdlib"),
        "--tokenizer-type",
        request.param,
        "--train-bpe",
        "512",
        "--train-bpe-dir",
        str(folder / "tokenizer"),
        "--tiktoken-num-special-tokens",
        "16",
        "--append-eod",
    ]
    out = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    flags = next(line for line in out.stdout.splitlines() if line.startswith("pretrain_gpt.py:"))
    return folder, flags.split(":", 1)[1].split()


def test_sentencepiece_and_tiktoken_read_back_what_they_were_trained_on(trained):
    folder, flags = trained
    args = build_parser().parse_args((NO_VOCAB + " " + " ".join(flags)).split())
    validate_args(args, 1, cuda_available=False)
    tokenizer = tokenizer_from_args(args)
    text = "def f(x):\n    return {'key': x}  # code\n"
    ids = tokenizer.tokenize(text)
    assert tokenizer.detokenize(ids) == text and len(ids) < len(text)  # merges apply
    assert tokenizer.eod == 2  # megatron-core's </s>, after <unk> and <s>
    if args.tokenizer_type == "TikTokenizer":  # 16 special ids, then the BPE's 511 entries
        assert tokenizer.vocab_size == args.vocab_size == 16 + 511
    else:  # Megatron-LM's size: the model's 512 pieces and <CLS> <SEP> <EOD> <MASK> <PAD>
        assert tokenizer.vocab_size == 517


def test_tiktoken_flags_are_checked_by_name(bpe, tmp_path):
    vocab = str(bpe / "tokenizer" / "tiktoken.json")

    def args(extra):
        parsed = build_parser().parse_args(
            (NO_VOCAB + " --tokenizer-type TikTokenizer " + extra).split()
        )
        validate_args(parsed, 1, cuda_available=False)

    with pytest.raises(ArgumentError, match=r"--vocab-size 131072: .* pass --vocab-size 1511"):
        args(f"--tokenizer-model {vocab}")  # megatron-core's default size, 1000 special ids
    with pytest.raises(ArgumentError, match=r"--tiktoken-num-special-tokens \(4\) must be"):
        args(f"--tokenizer-model {vocab} --tiktoken-num-special-tokens 4 --vocab-size 300")
    with pytest.raises(ArgumentError, match="must be distinct and include .* missing <cls> <sep>"):
        args(f"--tokenizer-model {vocab} --tokenizer-special-tokens <unk> <s> </s> <mask> <pad>")
    not_tiktoken = str(bpe / "tokenizer" / "vocab.json")
    with pytest.raises(ArgumentError, match="a tiktoken vocabulary"):
        args(f"--tokenizer-model {not_tiktoken} --vocab-size 1100")
    with pytest.raises(ArgumentError, match="needs --tokenizer-model: a file"):
        args(f"--tokenizer-model {tmp_path} --tokenizer-type SentencePieceTokenizer")
    with pytest.raises(ArgumentError, match="SentencePieceTokenizer takes its special tokens"):
        args(
            f"--tokenizer-model {vocab} --tokenizer-type SentencePieceTokenizer "
            "--tokenizer-special-tokens <unk>"
        )


def test_a_tp2_model_learns_with_sentencepiece_and_tiktoken(trained):
    folder, flags = trained
    argv = (
        MHA.replace("--mock-data --vocab-size 255", f"--data-path {folder}/stdlib_text_document")
        .replace("--train-iters 1", "--train-iters 20")
        .replace("--lr 1e-3", "--lr 3e-3")
        + " --split 90,10,0 --tensor-model-parallel-size 2 --global-batch-size 8 --eval-iters 0"
        + " --het-tp "
        + " ".join(flags)
    ).split()
    losses = run_ranks(train, 2, argv)[0]["losses"]
    early = sum(losses[i] for i in range(1, 6)) / 5
    late = sum(losses[i] for i in range(16, 21)) / 5
    assert late < early - 0.3, (early, late)
