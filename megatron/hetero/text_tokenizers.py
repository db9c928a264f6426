"""Megatron-LM's file-based tokenizers, offline.

megatron-core's own GPT2BPETokenizer and HuggingFaceTokenizer go through `transformers`
(AutoTokenizer), a large dependency that reaches for the hub; the Rust `tokenizers` library
reads the same files (GPT-2's vocab.json + merges.txt, a folder's tokenizer.json) with nothing
else. `FileTokenizer` has the interface megatron-core's datasets use: vocab_size, eod, pad,
tokenize, detokenize. SentencePieceTokenizer and TikTokenizer are megatron-core's own (what
Megatron-LM builds for them unless --legacy-tokenizer): they read local files only; this module
checks those files and flags first, so a mistake is named instead of failing an assert.
"""

from __future__ import annotations

import base64
import json
import os
import types
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
    """Train a byte-level BPE (GPT-2's kind) on `texts` and write vocab.json, merges.txt,
    tokenizer.json and tiktoken.json into `output_dir`: what GPT2BPETokenizer (--vocab-file,
    --merge-file), HuggingFaceTokenizer (--tokenizer-model output_dir) and TikTokenizer
    (--tokenizer-model output_dir/tiktoken.json) read. Returns the paths."""
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
    tiktoken_file = write_tiktoken_vocab(merges, os.path.join(output_dir, "tiktoken.json"))
    return {
        "vocab_file": vocab,
        "merge_file": merges,
        "tokenizer_model": output_dir,
        "tiktoken_file": tiktoken_file,
    }


# Megatron-LM's names that megatron-core reads with the sentencepiece library
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
# megatron-core's TikTokenizer: the special tokens every vocabulary must list, and the default size
TIKTOKEN_SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")
TIKTOKEN_DEFAULT_VOCAB_SIZE = 2**17


def _megatron_core_tokenizer(**flags):
    from megatron.core.tokenizers.text.utils.build_tokenizer import build_tokenizer

    defaults = dict(
        tokenizer_special_tokens=None,
        tokenizer_metadata=None,
        tokenizer_sentencepiece_legacy=False,
        tiktoken_pattern=None,
        tiktoken_num_special_tokens=1000,
        vocab_size=None,
    )
    return build_tokenizer(types.SimpleNamespace(**{**defaults, **flags}))


class SentencePieceVocab:
    """megatron-core's SentencePiece tokenizer (ids, end of document), with the vocabulary size
    Megatron-LM gives the model: it sizes the embedding from its legacy tokenizer, which appends
    <CLS> <SEP> <EOD> <MASK> and any pad/bos/eos piece the model lacks, so checkpoints keep
    Megatron-LM's shapes."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer, self.vocab_size = tokenizer, vocab_size

    def __getattr__(self, name):  # eod, pad, tokenize, detokenize, unique_identifiers, ...
        return getattr(self._tokenizer, name)


def _megatron_lm_sentencepiece_size(model: str) -> int:
    """Megatron-LM's legacy _SentencePieceTokenizer's vocabulary size for `model`."""
    import sentencepiece as spm

    processor = spm.SentencePieceProcessor(model_file=model)
    pieces = {processor.id_to_piece(i) for i in range(len(processor))}
    added = ["<CLS>", "<SEP>", "<EOD>", "<MASK>"]
    for piece_id, fallback in (
        (processor.pad_id(), "<PAD>"),
        (processor.bos_id(), "<BOS>"),
        (processor.eos_id(), "<EOS>"),
    ):
        try:
            added.append(processor.id_to_piece(piece_id))
        except IndexError:  # the model has none (id -1)
            added.append(fallback)
    return len(pieces | set(added))


def sentencepiece(tokenizer_type: str, model: str, special_tokens=None) -> SentencePieceVocab:
    """SentencePieceTokenizer (and Megatron-LM's other names for it): a .model file."""
    if not model or not os.path.isfile(model):
        raise TokenizerFileError(
            f"--tokenizer-type {tokenizer_type} needs --tokenizer-model: a SentencePiece .model "
            f"file, got {model!r}"
        )
    if special_tokens:  # megatron-core's non-legacy SentencePiece takes none
        raise TokenizerFileError(
            f"--tokenizer-special-tokens: {tokenizer_type} takes its special tokens from the "
            "model file"
        )
    try:
        tokenizer = _megatron_core_tokenizer(tokenizer_type=tokenizer_type, tokenizer_model=model)
        return SentencePieceVocab(tokenizer, _megatron_lm_sentencepiece_size(model))
    except (RuntimeError, OSError) as err:  # sentencepiece's parse error
        raise TokenizerFileError(f"--tokenizer-model {model}: {err}") from None


def tiktoken_vocab_size(
    path: str, vocab_size: int | None, num_special_tokens: int, special_tokens=None
) -> int:
    """The vocabulary size TikTokenizer will have, after checking the file and flags the way
    megatron-core's asserts would, but naming them: special ids come first
    (--tiktoken-num-special-tokens), then the file's first vocab_size - that many entries."""
    if not path or not path.endswith(".json") or not os.path.isfile(path):
        raise TokenizerFileError(
            "--tokenizer-type TikTokenizer needs --tokenizer-model: a tiktoken vocabulary "
            f"(.json, Megatron's format), got {path!r}"
        )
    special = list(special_tokens or TIKTOKEN_SPECIAL_TOKENS)
    missing = [t for t in TIKTOKEN_SPECIAL_TOKENS if t not in special]
    if missing or len(set(special)) != len(special):
        raise TokenizerFileError(
            "--tokenizer-special-tokens must be distinct and include "
            f"{' '.join(TIKTOKEN_SPECIAL_TOKENS)} (TikTokenizer), missing {' '.join(missing)}"
        )
    size = vocab_size or TIKTOKEN_DEFAULT_VOCAB_SIZE
    if not len(special) <= num_special_tokens < size:
        raise TokenizerFileError(
            f"--tiktoken-num-special-tokens ({num_special_tokens}) must be at least the "
            f"{len(special)} special tokens and below --vocab-size ({size})"
        )
    try:
        with open(path) as f:
            entries = json.load(f)
        for rank, entry in enumerate(entries):
            token = base64.b64decode(entry["token_bytes"])
            if entry["rank"] != rank or (rank < 256 and token != bytes([rank])):
                raise ValueError(f"entry {rank} is out of order")
    except (ValueError, KeyError, TypeError) as err:
        raise TokenizerFileError(
            f"--tokenizer-model {path}: not a tiktoken vocabulary (a list of "
            f"{{rank, token_bytes, token_str}}, the 256 single bytes first): {err}"
        ) from None
    if size - num_special_tokens > len(entries):
        raise TokenizerFileError(
            f"--vocab-size {size}: TikTokenizer takes --tiktoken-num-special-tokens "
            f"({num_special_tokens}) plus at most the {len(entries)} entries of {path}: "
            f"pass --vocab-size {num_special_tokens + len(entries)} or less"
        )
    return size


def tiktoken(
    path: str,
    pattern: str | None,
    vocab_size: int | None,
    num_special_tokens: int,
    special_tokens=None,
):
    """TikTokenizer: a tiktoken vocabulary in Megatron's JSON format."""
    size = tiktoken_vocab_size(path, vocab_size, num_special_tokens, special_tokens)
    return _megatron_core_tokenizer(
        tokenizer_type="TikTokenizer",
        tokenizer_model=path,
        tiktoken_pattern=pattern,
        vocab_size=size,
        tiktoken_num_special_tokens=num_special_tokens,
        tokenizer_special_tokens=special_tokens,
    )


def _gpt2_byte_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: each byte as the printable character vocab.json spells it
    with (printable Latin-1 bytes stand for themselves, the rest are shifted past 255)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    shifted = iter(range(256, 512))
    return {chr(b if b in printable else next(shifted)): b for b in range(256)}


def write_tiktoken_vocab(merge_file: str, path: str) -> str:
    """The byte-level BPE of `merge_file` as a tiktoken vocabulary in Megatron's format: the 256
    bytes, then each merge's token in merge order (tiktoken merges by the rank of the result)."""
    alphabet = _gpt2_byte_alphabet()
    ranks: dict[bytes, int] = {bytes([b]): b for b in range(256)}
    with open(merge_file, encoding="utf-8") as f:
        for line in f:
            if line.startswith("#version") or not line.strip():
                continue
            left, right = line.rstrip("\n").split(" ")
            token = bytes(alphabet[c] for c in left + right)
            ranks.setdefault(token, len(ranks))
    entries = [
        {
            "rank": rank,
            "token_bytes": base64.b64encode(token).decode("ascii"),
            "token_str": token.decode("utf-8", errors="replace"),
        }
        for token, rank in ranks.items()
    ]
    with open(path, "w") as f:
        json.dump(entries, f)
    return path


def train_sentencepiece(texts, vocab_size: int, output_dir: str) -> str:
    """Train a SentencePiece BPE model on `texts` (line by line; whitespace kept, so code reads
    back as written) and write sentencepiece.model into `output_dir`. Returns its path."""
    import sentencepiece as spm

    os.makedirs(output_dir, exist_ok=True)
    prefix = os.path.join(output_dir, "sentencepiece")
    lines = (line for text in texts for line in text.splitlines() if line.strip())
    spm.SentencePieceTrainer.train(
        sentence_iterator=lines,
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type="bpe",
        character_coverage=1.0,
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    return prefix + ".model"
