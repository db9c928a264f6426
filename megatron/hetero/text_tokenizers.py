"""Megatron-LM's file-based tokenizers, offline, on Hugging Face's `tokenizers` library.

megatron-core's own GPT2BPETokenizer and HuggingFaceTokenizer go through `transformers`
(AutoTokenizer), a large dependency that reaches for the hub; the Rust `tokenizers` library
reads the same files (GPT-2's vocab.json + merges.txt, a folder's tokenizer.json) with nothing
else. `FileTokenizer` has the interface megatron-core's datasets use: vocab_size, eod, pad,
tokenize, detokenize.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict

GPT2_EOD = "<|endoftext|>"
# end-of-document names, in the order a tokenizer.json without tokenizer_config.json is searched
_EOD_NAMES = (GPT2_EOD, "<|end_of_text|>", "</s>", "<eos>", "<|eos|>")


class TokenizerFileError(ValueError):
    """A tokenizer file is missing or unusable."""


class FileTokenizer:
    def __init__(self, tokenizer, eod_token: str, name: str, files: tuple[str, ...]):
        eod = tokenizer.token_to_id(eod_token)
        if eod is None:
            raise TokenizerFileError(f"{name}: no end-of-document token {eod_token!r}")
        self._tokenizer, self.eod, self.name = tokenizer, eod, name
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        # megatron-core's datasets name their index caches after these
        self.unique_identifiers = OrderedDict(
            [("class", name), ("files", [os.path.abspath(f) for f in files])]
        )

    @property
    def pad(self) -> int:
        return self.eod  # as Megatron-LM's GPT2 tokenizer: no pad token of its own

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def detokenize(self, ids) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)


def gpt2_bpe(vocab_file: str, merge_file: str) -> FileTokenizer:
    """GPT2BPETokenizer: byte-level BPE from GPT-2's vocab.json and merges.txt."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not path or not os.path.isfile(path):
            raise TokenizerFileError(f"GPT2BPETokenizer needs {flag}: {path!r} is not a file")
    try:
        tokenizer = Tokenizer(models.BPE.from_file(vocab_file, merge_file))
    except Exception as err:  # the Rust error names the problem, not the flag
        raise TokenizerFileError(
            f"--vocab-file {vocab_file} / --merge-file {merge_file}: {err}"
        ) from None
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return FileTokenizer(tokenizer, GPT2_EOD, "GPT2BPETokenizer", (vocab_file, merge_file))


def huggingface(model: str) -> FileTokenizer:
    """HuggingFaceTokenizer: a local folder holding tokenizer.json (tokenizer_config.json, if
    there, names the end-of-sequence token), or a tokenizer.json file."""
    from tokenizers import Tokenizer

    folder = model if os.path.isdir(model or "") else os.path.dirname(model or "")
    path = os.path.join(model, "tokenizer.json") if os.path.isdir(model or "") else model
    if not path or not os.path.isfile(path):
        raise TokenizerFileError(
            f"--tokenizer-model {model!r}: expected a local folder with tokenizer.json "
            "(hettp reads tokenizers offline)"
        )
    try:
        tokenizer = Tokenizer.from_file(path)
    except Exception as err:
        raise TokenizerFileError(f"--tokenizer-model {model}: {err}") from None
    eod = _configured_eos(folder)
    if eod is None:
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        eod = next((name for name in _EOD_NAMES if name in vocab), None)
    if eod is None:
        raise TokenizerFileError(
            f"--tokenizer-model {model}: no end-of-sequence token (set eos_token in "
            f"tokenizer_config.json, or use one of {', '.join(_EOD_NAMES)})"
        )
    return FileTokenizer(tokenizer, eod, "HuggingFaceTokenizer", (path,))


def _configured_eos(folder: str) -> str | None:
    config = os.path.join(folder, "tokenizer_config.json")
    if not os.path.isfile(config):
        return None
    with open(config) as f:
        eos = json.load(f).get("eos_token")
    if isinstance(eos, dict):  # {"content": "</s>", ...}
        eos = eos.get("content")
    return eos


def train_byte_level_bpe(texts, vocab_size: int, output_dir: str) -> dict:
    """Train a byte-level BPE (GPT-2's kind) on `texts` and write vocab.json, merges.txt and
    tokenizer.json into `output_dir`: what GPT2BPETokenizer (--vocab-file, --merge-file) and
    HuggingFaceTokenizer (--tokenizer-model output_dir) read. Returns the paths."""
    from tokenizers import ByteLevelBPETokenizer

    os.makedirs(output_dir, exist_ok=True)
    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(
        texts, vocab_size=vocab_size, min_frequency=2, special_tokens=[GPT2_EOD]
    )
    vocab, merges = tokenizer.save_model(output_dir)
    tokenizer.save(os.path.join(output_dir, "tokenizer.json"))
    with open(os.path.join(output_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": GPT2_EOD}, f)
    return {"vocab_file": vocab, "merge_file": merges, "tokenizer_model": output_dir}
