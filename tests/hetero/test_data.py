"""The data-parallel sampler and the indexed-dataset preprocessing tool."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from megatron.hetero.data import PretrainingSampler, build_tokenizer
from tests.utils import BASE, damage, load_script, make_corpus


def test_dp_ranks_split_each_global_batch_like_megatron():
    dp, mbs = 2, 3
    per_rank = [list(PretrainingSampler(24, 0, mbs, r, dp)) for r in range(dp)]
    assert per_rank[0][:2] == [[0, 1, 2], [6, 7, 8]]
    assert per_rank[1][:2] == [[3, 4, 5], [9, 10, 11]]
    seen = sorted(i for rank in per_rank for batch in rank for i in batch)
    assert seen == list(range(24))
    assert len(PretrainingSampler(24, 0, mbs, 0, dp)) == 4


def test_sampler_resumes_at_consumed_samples():
    full = list(PretrainingSampler(40, 0, 2, 1, 2))
    resumed = list(PretrainingSampler(40, 12, 2, 1, 2))
    assert resumed == full[3:]
    with pytest.raises(ValueError, match="no samples left"):
        PretrainingSampler(40, 40, 2, 0, 2)


preprocess_data = load_script("preprocess_data")


def _preprocess(capsys, *args):
    """The script's main in this process: (exit status, stdout, stderr)."""
    try:
        preprocess_data.main(list(args))
        status = 0
    except SystemExit as exc:
        status = exc.code if isinstance(exc.code, int) else 1
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
    out, err = capsys.readouterr()
    return status, out, err


def test_preprocess_jsonl_roundtrip(tmp_path, capsys):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    docs = ["héllo wörld", "second document\nwith two lines", "x"]
    # Megatron-LM's examples name the JSON-lines input .json: read alike, not as one text
    for name in ("in.jsonl", "in.json"):
        src = tmp_path / name
        src.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
        prefix = tmp_path / name.replace(".", "_")
        status, out, err = _preprocess(
            capsys, "--input", str(src), "--output-prefix", str(prefix), "--append-eod"
        )
        assert status == 0, err
        assert "3 documents" in out
        dataset = IndexedDataset(f"{prefix}_text_document")
        tokenizer = build_tokenizer("ByteLevelTokenizer")
        assert len(dataset) == 3
        for i, doc in enumerate(docs):
            ids = dataset[i]
            assert ids[-1] == tokenizer.eod
            assert tokenizer.detokenize(ids[:-1].tolist()) == doc
        assert dataset.index.dtype == np.uint16


def test_preprocess_text_folder_is_deterministic_and_bounded(tmp_path, capsys):
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_text("bbbb")
    (folder / "a.txt").write_text("aaaa")
    (folder / "sub" / "c.txt").write_text("cééé")  # 7 bytes: cut at a whole character
    (folder / "skip.md").write_text("not matched")
    status, _, err = _preprocess(
        capsys,
        "--input",
        str(folder),
        "--glob",
        "*.txt",
        "--max-bytes",
        "10",
        "--output-prefix",
        str(tmp_path / "out"),
    )
    assert status == 0, err
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    dataset = IndexedDataset(str(tmp_path / "out_text_document"))
    texts = [bytes(dataset[i].tolist()).decode() for i in range(len(dataset))]
    assert texts == ["aaaa", "bbbb", "c"]  # 10 bytes; "cé" would be 11


def test_a_json_file_in_an_input_folder_is_a_text(tmp_path, capsys):
    """Only a .json file --input names itself is read as JSON lines (Megatron-LM's inputs);
    one inside a folder (a package.json) is a document like the folder's other files."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("aaaa")
    (folder / "config.json").write_text('{\n  "a": 1\n}')
    out = str(tmp_path / "out")
    status, _, err = _preprocess(capsys, "--input", str(folder), "--output-prefix", out)
    assert status == 0, err
    dataset = IndexedDataset(f"{out}_text_document")
    texts = [bytes(dataset[i].tolist()).decode() for i in range(len(dataset))]
    assert texts == ["aaaa", '{\n  "a": 1\n}']


def test_preprocess_errors_are_clear(tmp_path, capsys):
    status, _, err = _preprocess(
        capsys, "--input", str(tmp_path / "missing.jsonl"), "--output-prefix", str(tmp_path / "o")
    )
    assert status == 2 and "--input" in err and "no such file" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "x"}\n')
    status, _, err = _preprocess(
        capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "o")
    )
    assert status == 1 and "bad.jsonl:1: no key 'text' (--json-keys)" in err
    bad.write_bytes(b'{"text": "x"}\n{"text": "\xff"}\n')
    status, _, err = _preprocess(
        capsys, "--input", str(bad), "--output-prefix", str(tmp_path / "o")
    )
    assert status == 1 and "bad.jsonl:2: not UTF-8" in err


@pytest.mark.parametrize(
    "ext,how,message",
    [
        (".bin", "truncate", ".bin is corrupt: "),
        (".idx", "truncate", ".idx is corrupt: "),
        (".idx", "header", ".idx is corrupt: not a megatron-core index"),
        (".idx", "sequence count", ".idx is corrupt: "),
    ],
)
def test_a_damaged_dataset_file_is_named_before_training(tmp_path, ext, how, message):
    from megatron.hetero.dataset_files import DatasetFileError, check_indexed_dataset

    prefix = make_corpus(tmp_path)
    check_indexed_dataset(prefix)  # intact: no error
    if how == "sequence count":  # the header's count no longer matches the file
        damage(prefix + ext, "flip", offset=18)
    else:
        damage(prefix + ext, how)
    with pytest.raises(DatasetFileError) as err:
        check_indexed_dataset(prefix)
    assert str(err.value).startswith(prefix + ext + " is corrupt"), err.value
    assert message in str(err.value)


def _validate_on(prefix, extra: str) -> None:
    """The start-time checks of a run on the byte-level corpus at `prefix`, with `extra` flags
    (a later --data-path replaces it)."""
    from megatron.hetero.arguments import build_parser, validate_args

    base = BASE.replace(
        "--mock-data --vocab-size 255", f"--data-path {prefix} --tokenizer-type ByteLevelTokenizer"
    )
    validate_args(build_parser().parse_args((base + " " + extra).split()), 1, cuda_available=False)


def test_a_corpus_of_another_tokenizer_is_refused_before_training(tmp_path):
    """Token ids past the embedding's (padded) rows: megatron-core would index past them at
    TP=1 and embed zeros at TP > 1; a sample of the .bin finds them at start. Ids in the
    padding rows train (Megatron-LM runs them): a warning."""
    import numpy as np

    from megatron.hetero.arguments import ArgumentError
    from megatron.hetero.dataset_files import check_indexed_dataset, sampled_token_range

    prefix = make_corpus(tmp_path)
    tokens = np.fromfile(prefix + ".bin", dtype=np.uint16)
    indexed = check_indexed_dataset(prefix)
    assert indexed == tokens.nbytes  # every byte is some sequence's
    assert sampled_token_range(prefix, indexed) == (tokens.min(), tokens.max())  # all sampled
    one = "--split 1,0,0"  # four documents: a training split alone
    _validate_on(prefix, one)  # its own tokenizer
    top = int(tokens.max())  # NullTokenizer: ids 0..vocab-size (the last, end of document)
    null = f"{one} --tokenizer-type NullTokenizer --vocab-size"
    _validate_on(prefix, f"{null} {top}")
    with pytest.warns(UserWarning, match=f"holds token id {top}, .* has {top} entries: ids from"):
        _validate_on(prefix, f"{null} {top - 1}")  # padded to 128 rows: a padding row
    with pytest.raises(ArgumentError) as err:
        _validate_on(prefix, f"{null} {top - 1} --make-vocab-size-divisible-by 1")
    assert str(err.value) == (
        f"--data-path {prefix}: holds token id {top}, and --tokenizer-type NullTokenizer "
        f"--vocab-size {top - 1} has {top} entries ({top} embedding rows, padded): the data "
        "was tokenized with another tokenizer (give that one's flags, or preprocess the text "
        "again)"
    )
    with open(prefix + ".bin", "ab") as f:  # bytes past the index: no sequence's, not read
        f.write(np.array([9999], dtype=np.uint16).tobytes())
    _validate_on(prefix, one)
    with open(prefix + ".bin", "r+b") as f:  # an id past the byte-level rows, in the last one
        f.seek(indexed - 2)
        f.write(np.array([1000], dtype=np.uint16).tobytes())
    with pytest.raises(ArgumentError, match="holds token id 1000, and --tokenizer-type Byte"):
        _validate_on(prefix, one)


def test_a_split_megatron_core_cannot_build_is_refused_naming_it(tmp_path):
    """Every split of non-zero weight is built, asked for samples or not; one left no tokens
    would make megatron-core's builder loop forever (0 tokens per epoch never reach the
    samples asked): 4 sequences at 969,30,1 leave validation and test none."""
    from megatron.hetero.arguments import ArgumentError

    prefix = make_corpus(tmp_path)

    def check(extra):
        _validate_on(prefix, extra)

    for eval_iters in ("1", "0"):
        with pytest.raises(ArgumentError) as err:
            check(f"--eval-iters {eval_iters}")
        assert str(err.value) == (
            f"--split '969, 30, 1': the validation split of {prefix} gets none of its 4 "
            "sequences; megatron-core cannot build it: give the split weight 0 or a larger one, "
            "or more data"
        )
    check("--split 50,25,25")  # 2, 1 and 1 sequences
    check("--split 3,1,0")  # 3 and 1; no test split
    # megatron-core's arithmetic: 0.7/0.2/0.1 of 5 puts 1 in validation and none in test
    (tmp_path / "five").mkdir()
    five = make_corpus(tmp_path / "five", documents=5)
    with pytest.raises(ArgumentError, match="the test split of .* gets none of its 5"):
        check(f"--data-path {five} --split 0.7,0.2,0.1")
    # an unweighted blend builds each dataset once through: a split needs a whole sample
    blend = []
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        blend.append(make_corpus(tmp_path / name, documents=8))  # 56 tokens each
    seq = "--seq-length 128 --max-position-embeddings 128 --split 6,1,1"
    with pytest.raises(ArgumentError) as err:
        check(f"{seq} --data-path {blend[0]} {blend[1]}")
    assert (
        f"the validation split of {blend[0]} gets 56 tokens of its 8 sequences (an unweighted "
        "blend needs --seq-length + 1 = 129)"
    ) in str(err.value)
    check(f"{seq} --data-path 0.5 {blend[0]} 0.5 {blend[1]}")  # weighted: sampled in epochs


def test_the_dataset_index_cache_must_be_writable_at_start(tmp_path):
    """megatron-core writes it after the model is built and a checkpoint loaded; there, a
    folder it cannot write stopped rank 0 with an error naming no flag."""
    from megatron.hetero.arguments import ArgumentError

    prefix = make_corpus(tmp_path)

    def check(extra):
        _validate_on(prefix, "--split 50,25,25 " + extra)

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(ArgumentError, match=f"--data-cache-path {blocker}/cache: not writable"):
        check(f"--data-cache-path {blocker}/cache")
    check(f"--data-cache-path {tmp_path}/elsewhere")
    assert not (tmp_path / "elsewhere").exists()  # checked, not created
    # megatron-core's default, a cache/ folder under the prefix, cannot be made (a file named
    # as the prefix is in its way): refused naming the flag that moves it
    with open(prefix, "w"):
        pass
    with pytest.raises(ArgumentError, match=f"the default under {prefix}.*give --data-cache-path"):
        check("")
    # a cache built already (a read-only shared one, say) is only read: not refused
    built = tmp_path / "built"
    built.mkdir()
    (built / "index.npy").write_text("")
    check(f"--data-cache-path {built}/")


def test_each_split_from_its_own_datasets(tmp_path):
    """--train-data-path and --valid-data-path (Megatron-LM's per-split datasets): training
    reads the train datasets as --data-path with all of --split on train would, evaluation
    reads the valid ones."""
    from tests.utils import run_ranks, train

    prefixes = {}
    for name, documents in (("a", 6), ("b", 11)):  # two corpora (make_corpus numbers its texts)
        (tmp_path / name).mkdir()
        prefixes[name] = make_corpus(tmp_path / name, documents=documents)
    argv = (
        BASE.replace("--mock-data --vocab-size 255", "--tokenizer-type ByteLevelTokenizer")
        .replace("--train-iters 10", "--train-iters 4")
        .replace("--eval-iters 0", "--eval-iters 1 --eval-interval 2")
        + f" --global-batch-size 4 --hidden-dropout 0 --attention-dropout 0"
        f" --data-cache-path {tmp_path / 'cache'}"
    ).split()
    a, b = prefixes["a"], prefixes["b"]
    own = run_ranks(train, 1, argv + ["--train-data-path", a, "--valid-data-path", b])[0]
    whole = run_ranks(train, 1, argv + ["--data-path", a, "--split", "100,0,0"])[0]
    same = run_ranks(train, 1, argv + ["--train-data-path", a, "--valid-data-path", a])[0]
    assert own["losses"] == whole["losses"] == same["losses"]
    assert sorted(own["eval_losses"]) == [2, 4] and not whole["eval_losses"]
    assert own["eval_losses"][2] != same["eval_losses"][2]  # another corpus evaluated


def test_per_split_dataset_flags_are_checked_by_name(tmp_path):
    from megatron.hetero.arguments import ArgumentError

    prefix = make_corpus(tmp_path)
    (tmp_path / "one").mkdir()
    short = make_corpus(tmp_path / "one", documents=1)  # 56 tokens
    long = "--seq-length 128 --max-position-embeddings 128"
    for extra, message in [
        (f"--train-data-path {prefix}", "--data-path and --train-/--valid-/--test-data-path"),
        (f"--data-path --valid-data-path {prefix}", "need --train-data-path"),
        (f"--data-path --train-data-path {tmp_path}/x", f"--train-data-path {tmp_path}/x: no"),
        (
            f"{long} --data-path --train-data-path {prefix} --test-data-path {short}",
            f"--test-data-path {short}: 56 tokens, less than one sample (--seq-length + 1 = 129)",
        ),
        (f"--data-path --train-data-path 1 {prefix} {prefix}", "--train-data-path 1 "),
    ]:
        with pytest.raises(ArgumentError) as err:
            _validate_on(prefix, extra)
        assert message in str(err.value), (extra, str(err.value))
    _validate_on(prefix, f"--data-path --train-data-path {prefix} --valid-data-path {prefix}")


def test_data_paths_from_files(tmp_path):
    """Megatron-LM's --data-args-path (--data-path's list in a file) and
    --per-split-data-args-path (each split's, in a JSON file) build the datasets the flags
    would, and are checked at start by name."""
    from megatron.hetero.arguments import ArgumentError, build_parser, validate_args
    from megatron.hetero.data import dataset_config, tokenizer_from_args

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    a, b = make_corpus(tmp_path / "a"), make_corpus(tmp_path / "b")
    base = BASE.replace(
        "--mock-data --vocab-size 255", "--tokenizer-type ByteLevelTokenizer --split 100,0,0"
    )

    def config(extra):
        args = build_parser().parse_args((base + " " + extra).split())
        validate_args(args, 1, cuda_available=False)
        return dataset_config(args, tokenizer_from_args(args))

    blend = tmp_path / "blend.txt"
    blend.write_text(f"0.3 {a}\n0.7 {b}\n")
    by_file, by_flag = config(f"--data-args-path {blend}"), config(f"--data-path 0.3 {a} 0.7 {b}")
    assert by_file.blend == by_flag.blend == ([a, b], [0.3, 0.7])
    # The datasets are built from the lists validation checked, not from the file as it is later
    args = build_parser().parse_args(f"{base} --data-args-path {blend}".split())
    validate_args(args, 1, cuda_available=False)
    blend.write_text(f"1 {tmp_path}/unchecked\n")
    assert dataset_config(args, tokenizer_from_args(args)).blend == ([a, b], [0.3, 0.7])
    splits = tmp_path / "splits.json"
    splits.write_text(json.dumps({"train": f"{a} {b}", "valid": [b], "test": None}))
    by_file = config(f"--per-split-data-args-path {splits}")
    by_flag = config(f"--train-data-path {a} {b} --valid-data-path {b}")
    assert by_file.blend_per_split == by_flag.blend_per_split == [([a, b], None), ([b], None), None]

    bad = tmp_path / "bad.json"
    for extra, text, message in [
        (f"--data-path {a} --data-args-path {blend}", None, "--data-path and --data-args-path"),
        (
            f"--data-args-path {blend} --per-split-data-args-path {splits}",
            None,
            "--data-args-path and --per-split-data-args-path are exclusive",
        ),
        (f"--data-args-path {tmp_path}/none", None, f"--data-args-path {tmp_path}/none: No such"),
        (f"--data-args-path {bad}", "", f"--data-args-path {bad}: no datasets in it"),
        (f"--data-args-path {bad}", f"1 {tmp_path}/x", f"--data-args-path {bad}: {tmp_path}/x: no"),
        (f"--per-split-data-args-path {bad}", "{", f"--per-split-data-args-path {bad}: not JSON"),
        (f"--per-split-data-args-path {bad}", '{"dev": []}', "an object with train, valid and"),
        (f"--per-split-data-args-path {bad}", '{"train": 3}', "its train entry must be a list"),
        (f"--per-split-data-args-path {bad}", '{"train": null}', f"{bad}: no datasets in it"),
        (f"--per-split-data-args-path {bad}", f'{{"valid": "{a}"}}', f"{bad}: no train datasets"),
        (
            f"--per-split-data-args-path {bad}",
            f'{{"train": "{tmp_path}/x"}}',
            f"--per-split-data-args-path {bad} (train): {tmp_path}/x: no",
        ),
        (
            f"--train-data-path {a} --per-split-data-args-path {splits}",
            None,
            "--per-split-data-args-path and --train-/--valid-/--test-data-path are exclusive",
        ),
    ]:
        if text is not None:
            bad.write_text(text)
        with pytest.raises(ArgumentError) as err:
            config(extra)
        assert message in str(err.value), (extra, str(err.value))
