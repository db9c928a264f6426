#!/usr/bin/env python
"""Turn text into Megatron's indexed dataset (.bin/.idx) with megatron-core's builder.

Inputs, any mix of:
  *.jsonl     one JSON object per line; --json-keys names the text field(s) (Megatron-LM's
              format; a .json file given itself too, as Megatron-LM's examples name them)
  other files one document per file (plain text)
  folders     every file under it matching --glob, in sorted order

Output: <output-prefix>_<key>_document.bin/.idx, as Megatron-LM's tools/preprocess_data.py
names them (key is "text" for non-JSONL inputs). Pass that prefix to --data-path.

The real-text corpus the tests and benchmarks use is the Python standard library's own source,
which ships with every Python:

  python scripts/preprocess_data.py --stdlib --output-prefix data/stdlib --max-bytes 8000000

With a tokenizer trained on the same inputs first (--train-bpe VOCAB_SIZE --train-bpe-dir DIR):
a byte-level BPE (GPT-2's kind) written as vocab.json + merges.txt (--tokenizer-type
GPT2BPETokenizer, the default here, --vocab-file --merge-file), tokenizer.json
(HuggingFaceTokenizer --tokenizer-model DIR) and tiktoken.json (TikTokenizer --tokenizer-model
DIR/tiktoken.json); or with --tokenizer-type SentencePieceTokenizer, a SentencePiece BPE model
(DIR/sentencepiece.model). The data is tokenized with the --tokenizer-type one:

  python scripts/preprocess_data.py --stdlib --output-prefix data/stdlib-bpe \
      --max-bytes 8000000 --train-bpe 4096 --train-bpe-dir data/bpe --append-eod
"""

from __future__ import annotations

import argparse
import json
import os
import sysconfig
import warnings

warnings.filterwarnings("ignore", message=r".*(Apex|Transformer Engine).* not installed.*")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder  # noqa: E402

from megatron.hetero.arguments import add_tokenizer_args  # noqa: E402
from megatron.hetero.data import tokenizer_from_args  # noqa: E402
from megatron.hetero.text_tokenizers import (  # noqa: E402
    SENTENCEPIECE_TYPES,
    TokenizerFileError,
    train_byte_level_bpe,
    train_sentencepiece,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--input", nargs="*", default=[], help="JSONL files, text files or folders")
    p.add_argument(
        "--stdlib",
        action="store_true",
        help="add this Python's standard library sources (*.py) as documents",
    )
    p.add_argument("--glob", default="*", help="file pattern inside input folders (default: *)")
    p.add_argument("--json-keys", nargs="+", default=["text"])
    p.add_argument("--output-prefix", required=True)
    add_tokenizer_args(
        p, type_help="default: ByteLevelTokenizer, or GPT2BPETokenizer with --train-bpe"
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="for NullTokenizer: documents are whitespace-separated ids below this; "
        "TikTokenizer: its vocabulary size",
    )
    p.add_argument(
        "--train-bpe",
        type=int,
        default=None,
        metavar="VOCAB_SIZE",
        help="first train a tokenizer of this vocabulary size on the inputs (within "
        "--max-bytes) into --train-bpe-dir, then tokenize with it: a byte-level BPE, or a "
        "SentencePiece BPE with --tokenizer-type SentencePieceTokenizer",
    )
    p.add_argument("--train-bpe-dir", default=None)
    p.add_argument("--append-eod", action="store_true", help="end every document with EOD")
    p.add_argument(
        "--max-bytes",
        type=int,
        default=None,
        help="stop after this many bytes of text (deterministic prefix of the input)",
    )
    args = p.parse_args(argv)
    if not args.input and not args.stdlib:
        p.error("give --input and/or --stdlib")
    if args.tokenizer_type is None:
        args.tokenizer_type = "ByteLevelTokenizer" if args.train_bpe is None else "GPT2BPETokenizer"
    if args.tokenizer_type == "NullTokenizer" and not args.vocab_size:
        p.error("--tokenizer-type NullTokenizer needs --vocab-size")
    if args.train_bpe is not None:
        if args.train_bpe < 257 or not args.train_bpe_dir:
            p.error("--train-bpe needs a vocabulary size above 256 and --train-bpe-dir")
        if args.tokenizer_type in ("NullTokenizer", "ByteLevelTokenizer"):
            p.error(
                f"--train-bpe trains a tokenizer; --tokenizer-type {args.tokenizer_type} has none"
            )
    if args.max_bytes is not None and args.max_bytes <= 0:
        p.error(f"--max-bytes must be positive, got {args.max_bytes}")
    for path in args.input:
        if not os.path.exists(path):
            p.error(f"--input {path}: no such file or folder")
    return args


def _files_under(folder, pattern):
    import fnmatch

    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if d not in ("__pycache__", "site-packages"))
        found.extend(os.path.join(root, f) for f in files if fnmatch.fnmatch(f, pattern))
    return sorted(found)


def iter_documents(args):
    """Yields (key, text) in a fixed order, so the same inputs give the same dataset."""
    sources = list(args.input)
    if args.stdlib:
        sources.append(("stdlib", sysconfig.get_paths()["stdlib"]))
    for source in sources:
        given = False  # a file named by --input itself
        if isinstance(source, tuple):
            paths = _files_under(source[1], "*.py")
        elif os.path.isdir(source):
            paths = _files_under(source, args.glob)
        else:
            paths, given = [source], True
        for path in paths:
            # Megatron-LM's --input is JSON lines, often named .json; in a folder, a .json
            # file (a package.json, a config) is a text like any other
            if path.endswith(".jsonl") or (given and path.endswith(".json")):
                with open(path, "rb") as f:
                    for number, raw in enumerate(f, 1):
                        try:
                            line = raw.decode("utf-8")
                        except UnicodeDecodeError as err:
                            raise SystemExit(f"{path}:{number}: not UTF-8 ({err})") from None
                        if not line.strip():
                            continue
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as err:
                            raise SystemExit(f"{path}:{number}: not JSON ({err})") from None
                        for key in args.json_keys:
                            if key not in record:
                                raise SystemExit(f"{path}:{number}: no key '{key}' (--json-keys)")
                            yield key, record[key]
            else:
                with open(path, encoding="utf-8", errors="replace") as f:
                    yield "text", f.read()


def bounded_documents(args):
    """iter_documents within --max-bytes (the last one cut): what the dataset will hold."""
    total = 0
    for key, text in iter_documents(args):
        if args.max_bytes is not None and total >= args.max_bytes:
            return
        if args.max_bytes is not None:  # cut in bytes, at a whole character
            cut = text.encode("utf-8")[: max(0, args.max_bytes - total)]
            text = cut.decode("utf-8", errors="ignore")
        total += len(text.encode("utf-8"))
        yield key, text


def train(args) -> None:
    """--train-bpe: train the tokenizer --tokenizer-type reads, and point the flags at it."""
    texts = (text for _, text in bounded_documents(args))
    if args.tokenizer_type in SENTENCEPIECE_TYPES:
        args.tokenizer_model = train_sentencepiece(texts, args.train_bpe, args.train_bpe_dir)
        print(f"trained a SentencePiece BPE of {args.train_bpe} entries: {args.tokenizer_model}")
        return
    files = train_byte_level_bpe(texts, args.train_bpe, args.train_bpe_dir)
    args.vocab_file, args.merge_file = files["vocab_file"], files["merge_file"]
    if args.tokenizer_type == "HuggingFaceTokenizer":
        args.tokenizer_model = files["tokenizer_model"]
    elif args.tokenizer_type == "TikTokenizer":
        args.tokenizer_model = files["tiktoken_file"]
        with open(args.tokenizer_model) as f:
            entries = len(json.load(f))
        if args.vocab_size is None:  # all of it, after the special ids
            args.vocab_size = args.tiktoken_num_special_tokens + entries
    print(f"trained a byte-level BPE of {args.train_bpe} entries: {args.train_bpe_dir}")


def _tokenizer_flags(args, vocab_size: int) -> str:
    """The flags that make pretrain_gpt.py read the trained tokenizer."""
    if args.tokenizer_type == "GPT2BPETokenizer":
        return f"--vocab-file {args.vocab_file} --merge-file {args.merge_file}"
    flags = f"--tokenizer-model {args.tokenizer_model}"
    if args.tokenizer_type == "TikTokenizer":
        flags += f" --vocab-size {vocab_size}"
        if args.tiktoken_num_special_tokens != 1000:
            flags += f" --tiktoken-num-special-tokens {args.tiktoken_num_special_tokens}"
        if args.tiktoken_pattern:
            flags += f" --tiktoken-pattern {args.tiktoken_pattern}"
        if args.tokenizer_special_tokens:
            flags += " --tokenizer-special-tokens " + " ".join(args.tokenizer_special_tokens)
    return flags


def main(argv=None):
    args = parse_args(argv)
    if args.train_bpe is not None:
        train(args)
    try:
        tokenizer = tokenizer_from_args(args)  # this script's flags have pretrain_gpt.py's names
    except TokenizerFileError as err:
        raise SystemExit(f"preprocess_data.py: error: {err}") from None
    if args.train_bpe is not None:
        print(
            f"pretrain_gpt.py: --tokenizer-type {args.tokenizer_type} "
            + _tokenizer_flags(args, tokenizer.vocab_size)
        )
    dtype = DType.optimal_dtype(tokenizer.vocab_size)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    builders, counts = {}, {}
    for key, text in bounded_documents(args):
        ids = tokenizer.tokenize(text)
        if args.append_eod:
            ids = list(ids) + [tokenizer.eod]
        if not ids:
            continue
        if key not in builders:
            prefix = f"{args.output_prefix}_{key}_document"
            builders[key] = (IndexedDatasetBuilder(prefix + ".bin", dtype=dtype), prefix)
            counts[key] = [0, 0]
        builders[key][0].add_document(torch.from_numpy(np.asarray(ids, dtype=np.int64)), [len(ids)])
        counts[key][0] += 1
        counts[key][1] += len(ids)
    if not builders:
        raise SystemExit("no documents found in the inputs")
    for key, (builder, prefix) in builders.items():
        builder.finalize(prefix + ".idx")
        docs, tokens = counts[key]
        print(
            f"wrote {prefix}.bin/.idx: {docs} documents, {tokens} tokens "
            f"({args.tokenizer_type}, {np.dtype(dtype).name})"
        )


if __name__ == "__main__":
    main()
