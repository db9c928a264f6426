"""Tokenizers, megatron-core GPT datasets and the data-parallel sampler.

Every rank builds the datasets and reads its own micro-batches (a TP group's ranks read the same
ones), so no batch broadcast is needed. The sampler walks the global batches in order and hands
each data-parallel rank its slice, exactly as Megatron-LM's pretraining sampler does; so the
samples of a global batch are the same for any TP/DP split, and a resumed run picks up at
`consumed_samples`.
"""

from __future__ import annotations

import logging

import torch
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset
from megatron.core.tokenizers import MegatronTokenizer

from hettp import rebatch

from . import text_tokenizers
from .arguments import BYTE_LEVEL_VOCAB_SIZE, SPLITS, parse_data_path

_TOKENIZER_LIBRARY = {"NullTokenizer": "null", "ByteLevelTokenizer": "byte-level"}


def build_tokenizer(
    tokenizer_type: str,
    vocab_size: int | None = None,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tokenizer_model: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int = 1000,
    special_tokens: list[str] | None = None,
):
    """Offline tokenizers, by Megatron-LM's --tokenizer-type.

    NullTokenizer: ids are given (mock data, pre-tokenized text); vocab_size + 1 entries, the
    last one is end-of-document. ByteLevelTokenizer: UTF-8 bytes, 256 entries, byte 0 is
    end-of-document (both megatron-core's). GPT2BPETokenizer (vocab_file, merge_file),
    HuggingFaceTokenizer (tokenizer_model: a local folder), the SentencePiece ones
    (tokenizer_model: a .model file) and TikTokenizer (tokenizer_model: a .json vocabulary):
    text_tokenizers.
    """
    if tokenizer_type == "GPT2BPETokenizer":
        return text_tokenizers.gpt2_bpe(vocab_file, merge_file)
    if tokenizer_type == "HuggingFaceTokenizer":
        return text_tokenizers.huggingface(tokenizer_model)
    if tokenizer_type in text_tokenizers.SENTENCEPIECE_TYPES:
        return text_tokenizers.sentencepiece(tokenizer_type, tokenizer_model, special_tokens)
    if tokenizer_type == "TikTokenizer":
        return text_tokenizers.tiktoken(
            tokenizer_model,
            tiktoken_pattern,
            vocab_size,
            tiktoken_num_special_tokens,
            special_tokens,
        )
    library = _TOKENIZER_LIBRARY[tokenizer_type]
    if tokenizer_type == "ByteLevelTokenizer":
        vocab_size = BYTE_LEVEL_VOCAB_SIZE
    return MegatronTokenizer.from_pretrained(
        metadata_path={"library": library}, vocab_size=vocab_size
    )


def tokenizer_from_args(args):
    """The tokenizer pretrain_gpt.py's flags name."""
    return build_tokenizer(
        args.tokenizer_type,
        args.vocab_size,
        args.vocab_file,
        args.merge_file,
        args.tokenizer_model,
        args.tiktoken_pattern,
        args.tiktoken_num_special_tokens,
        args.tokenizer_special_tokens,
    )


class PretrainingSampler:
    """Yields this data-parallel rank's micro-batch indices, global batch after global batch.

    `counts` (--het-dp): every replica's micro-batches of a global batch; this rank's are the
    slots hettp.rebatch deals it (even counts: the same micro-batches as without)."""

    def __init__(
        self, total_samples, consumed_samples, micro_batch_size, dp_rank, dp_size, counts=None
    ):
        if consumed_samples >= total_samples:
            raise ValueError(f"no samples left: consumed {consumed_samples} of {total_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.dp_rank = dp_rank
        self.span = micro_batch_size * dp_size
        self.slots = None
        if counts is not None:
            self.span = micro_batch_size * sum(counts)  # a global batch
            self.slots = rebatch.slots(counts, dp_rank)

    def __len__(self):
        batches = (self.total_samples - self.consumed_samples) // self.span
        return batches * (len(self.slots) if self.slots is not None else 1)

    def __iter__(self):
        mbs = self.micro_batch_size
        starts = [s * mbs for s in self.slots] if self.slots is not None else [self.dp_rank * mbs]
        for first in range(self.consumed_samples, self.total_samples - self.span + 1, self.span):
            for start in starts:
                yield list(range(first + start, first + start + mbs))


def dataset_config(args, tokenizer) -> GPTDatasetConfig:
    """megatron-core's config: --data-path's blend cut by --split, or each split's own
    (--train-/--valid-/--test-data-path; a split without one is not built), as validate_args
    read and checked them."""
    blend = blend_per_split = None
    corpus = getattr(args, "data_corpus", None)
    if corpus is None:
        raise RuntimeError("dataset_config needs arguments that went through validate_args")
    if corpus.blend:
        blend = parse_data_path(corpus.blend, corpus.blend_flag)
    elif corpus.splits:
        blend_per_split = [
            parse_data_path(corpus.splits[split][1], corpus.splits[split][0])
            if split in corpus.splits
            else None
            for split in SPLITS
        ]
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split if blend else None,
        path_to_cache=args.data_cache_path,
        tokenizer=tokenizer,
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mmap_bin_files=args.mmap_bin_files,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
    )


def num_samples(args):
    """Samples asked of each split, as Megatron-LM asks them: --train-samples (or every
    iteration's global batch), every evaluation, one test pass."""
    evals = args.train_iters // args.eval_interval + 1
    return [
        args.train_samples or args.train_iters * args.global_batch_size,
        evals * args.eval_iters * args.global_batch_size,
        args.eval_iters * args.global_batch_size,
    ]


def build_datasets(args, tokenizer):
    """(train, valid, test) megatron-core datasets; valid/test may be None when not requested."""
    config = dataset_config(args, tokenizer)
    if not args.mock_data:
        return BlendedMegatronDatasetBuilder(
            GPTDataset, num_samples(args), lambda: True, config
        ).build()
    # Mock indexes are cheap to rebuild; megatron-core warns on every rank that it cannot
    # cache them, which is noise here.
    dataset_logger = logging.getLogger("megatron.core.datasets.gpt_dataset")
    level = dataset_logger.level
    dataset_logger.setLevel(logging.ERROR)
    try:
        return BlendedMegatronDatasetBuilder(
            MockGPTDataset, num_samples(args), lambda: True, config
        ).build()
    finally:
        dataset_logger.setLevel(level)


def _collate_dict(batch):
    return {
        key: torch.stack([torch.as_tensor(sample[key]) for sample in batch]) for key in batch[0]
    }


def build_loader(dataset, consumed_samples, args, dp_rank, dp_size, counts=None):
    sampler = PretrainingSampler(
        len(dataset), consumed_samples, args.micro_batch_size, dp_rank, dp_size, counts
    )
    # A private generator: creating a loader iterator draws a seed from it, and drawing from the
    # global one would shift dropout masks between a run and its resumed continuation.
    return torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=args.num_workers,
        collate_fn=_collate_dict,
        persistent_workers=args.num_workers > 0,
        generator=torch.Generator().manual_seed(args.seed),
    )


def get_batch(data_iterator, device):
    """One micro-batch as GPTModel's forward wants it, on `device`."""
    batch = next(data_iterator)
    mask = batch.get("attention_mask")
    return (
        batch["tokens"].long().to(device),
        batch["labels"].long().to(device),
        batch["loss_mask"].float().to(device),
        None if mask is None else mask.to(device),
        batch["position_ids"].long().to(device),
    )
