"""horse.data: shards round-trip, bad shards fail loudly, and the loader is deterministic, resumable and
splits the global batch over data-parallel replicas."""

import dataclasses
import json

import numpy as np
import pytest
import torch

from horse import data, train
from horse.data import ByteTokenizer, Loader, Split, load_dataset, prepare, read_shard, write_shard

TEXT = "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40


@pytest.fixture
def prepared(tmp_path):
    (tmp_path / "a.txt").write_text(TEXT)
    (tmp_path / "b.txt").write_text("All:\nSpeak, speak. Ünïcödé\n" * 30)
    out = tmp_path / "tokens"
    inputs = [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]
    data.main(["prepare", *inputs, "--out", str(out), "--shard-tokens", "1000"])
    return out


def _cut(text: bytes, val_fraction: float = 0.1) -> int:
    """Where prepare cuts a file into train and val: the line start before its last val_fraction."""
    return text.rfind(b"\n", 0, len(text) - int(len(text) * val_fraction)) + 1


def test_prepare_round_trips_bytes_into_shards(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes+eot" and meta["vocab_size"] == 257 and meta["eot_id"] == 256
    assert len(meta["train"]) > 1  # 1,000-token shards
    train, val, tokenizer = load_dataset(prepared)
    assert isinstance(tokenizer, ByteTokenizer) and tokenizer.eot_id == 256
    assert all(s.dtype == np.uint16 for s in train.shards)
    a, b = TEXT.encode(), ("All:\nSpeak, speak. Ünïcödé\n" * 30).encode()
    eot = [256]  # after each part of a document: the files do not run together in either split
    train_ids, val_ids = np.concatenate(train.shards).tolist(), np.concatenate(val.shards).tolist()
    assert train_ids == [*a[: _cut(a)], *eot, *b[: _cut(b)], *eot]
    assert val_ids == [*a[_cut(a) :], *eot, *b[_cut(b) :], *eot]
    assert tokenizer.decode(val_ids).endswith("Ünïcödé\n<|endoftext|>")


def test_uint32_shards_for_large_vocabularies(tmp_path):
    tokens = np.array([0, 65535, 65536, 99_999])
    write_shard(tmp_path / "big.bin", tokens, vocab_size=100_000)
    back, vocab = read_shard(tmp_path / "big.bin")
    assert back.dtype == np.uint32 and vocab == 100_000 and back.tolist() == tokens.tolist()
    write_shard(tmp_path / "small.bin", tokens[:2], vocab_size=65_535)
    assert read_shard(tmp_path / "small.bin")[0].dtype == np.uint16


def test_truncated_foreign_and_mismatched_shards_are_errors(prepared, tmp_path):
    shard = prepared / "train_000.bin"
    original = shard.read_bytes()
    shard.write_bytes(original[:-3])
    with pytest.raises(ValueError, match="train_000.bin: the header promises 1,000 tokens .* truncated"):
        load_dataset(prepared)
    shard.write_bytes(original[:10])
    with pytest.raises(ValueError, match="shorter than the 32-byte shard header"):
        load_dataset(prepared)
    shard.write_bytes(b"\x89PNG\r\n\x1a\n" + original[8:])
    with pytest.raises(ValueError, match="not a Little Horse token shard"):
        load_dataset(prepared)
    write_shard(shard, np.zeros(1000, dtype=np.int64), vocab_size=512)  # a shard of another data set
    with pytest.raises(ValueError, match="meta.json lists 1,000 of 257"):
        load_dataset(prepared)
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        load_dataset(tmp_path)


def test_tokens_outside_the_vocabulary_are_an_error():
    split = Split("test split", [np.full(100, 300, dtype=np.uint16)], vocab_size=256)
    with pytest.raises(ValueError, match="test split: token 300 is outside the vocabulary of 256"):
        Loader(split, 2, 8, seed=0).next()


def test_loader_is_deterministic_resumable_and_shifted_by_one():
    train, _, _ = load_dataset()
    a, b = Loader(train, 4, 32, seed=7), Loader(train, 4, 32, seed=7)
    batches = [a.next() for _ in range(5)]
    for x, y in batches:
        assert x.shape == y.shape == (4, 32) and x.dtype == torch.int64
        assert torch.equal(x[:, 1:], y[:, :-1])
    for x, y in batches:
        x2, y2 = b.next()
        assert torch.equal(x, x2) and torch.equal(y, y2)
    resumed = Loader(train, 4, 32, seed=0)
    resumed.load_state_dict(Loader(train, 4, 32, seed=7).state_dict() | {"position": 12})  # 3 batches
    assert torch.equal(resumed.next()[0], batches[3][0])
    assert not torch.equal(Loader(train, 4, 32, seed=8).next()[0], batches[0][0])


def test_data_parallel_replicas_read_disjoint_slices_of_the_global_batch():
    train, _, _ = load_dataset()
    whole = Loader(train, 6, 32, seed=7)
    replicas = [Loader(train, 2, 32, seed=7, dp_rank=r, dp_size=3) for r in range(3)]
    replicas[1].load_state_dict(replicas[0].state_dict() | {"position": 12})  # resumable like one loader
    whole.drawn, replicas[0].drawn, replicas[2].drawn = 12, 12, 12
    x, y = whole.next()
    parts = [r.next() for r in replicas]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(
        torch.cat([p[1] for p in parts]), y
    )
    assert not torch.equal(parts[0][0], parts[1][0])
    with pytest.raises(ValueError, match="dp_rank 3 must be in \\[0, dp_size 3\\)"):
        Loader(train, 2, 32, seed=7, dp_rank=3, dp_size=3)


# Token i is i: a window's first input token names it (window w starts at token w * SEQ_LEN). 97 windows
# an epoch, a prime, over three shards cut where windows cross them.
SEQ_LEN = 8
COUNTING = Split(
    "counting", np.split(np.arange(97 * SEQ_LEN + 1, dtype=np.uint32), [100, 333]), 97 * SEQ_LEN + 1
)


def _stream(loaders: list[Loader], steps: int) -> list[int]:
    """The windows the ranks' loaders draw in steps steps, in the job's order: each micro-batch's
    ranks one after another (their loaders share dp_size, batch_size and grad_accum)."""
    windows = []
    for _ in range(steps * loaders[0].grad_accum):
        for loader in loaders:
            x, y = loader.next()
            assert torch.equal(y[:, -1], x[:, 0] + SEQ_LEN)  # seq_len + 1 consecutive tokens
            windows += (x[:, 0] // SEQ_LEN).tolist()
    return windows


def _loaders(dp: int, batch: int, grad_accum: int) -> list[Loader]:
    return [
        Loader(COUNTING, batch, SEQ_LEN, 5, dp_rank=r, dp_size=dp, grad_accum=grad_accum) for r in range(dp)
    ]


def test_every_window_once_an_epoch_at_any_layout_and_across_a_resume():
    """A global batch of 12 windows made three ways draws one stream; each epoch of 97 draws holds
    every window once, in a new order; a resume at dp 4 (a global batch of 8) goes on where dp 2 was."""
    layouts = {(1, 12, 1), (2, 3, 2), (4, 3, 1)}
    # 17 steps, 204 draws: two epochs of 97 and 10 windows of the third
    streams = {layout: _stream(_loaders(*layout), steps=17) for layout in layouts}
    stream = streams[(1, 12, 1)]
    assert all(s == stream for s in streams.values())
    epochs = [stream[:97], stream[97:194]]
    assert all(sorted(epoch) == list(range(97)) for epoch in epochs) and epochs[0] != epochs[1]

    first = _loaders(2, 3, 2)
    drawn = _stream(first, steps=5)  # 60 windows, then a checkpoint
    resumed = _loaders(4, 2, 1)
    for loader in resumed:
        loader.load_state_dict(first[0].state_dict())
    assert "global batch is now 8 windows (dp 4 x batch 2 x grad_accum 1), the checkpoint's 12" in (
        resumed[0].layout_change
    )
    drawn += _stream(resumed, steps=18)  # to 204
    assert drawn == stream
    same_batch = _loaders(4, 3, 1)[0]
    same_batch.load_state_dict(first[0].state_dict())
    assert same_batch.layout_change is None and same_batch.drawn == 60


def test_loader_refuses_too_little_data_and_a_checkpoint_of_other_windows():
    with pytest.raises(ValueError, match="counting: 777 tokens, fewer than a window of seq_len \\+ 1 = 778"):
        Loader(COUNTING, 1, 777, seed=0)
    state = Loader(COUNTING, 1, 4, seed=0).state_dict()
    with pytest.raises(ValueError, match="had 194 windows an epoch, this data at seq_len 8 has 97"):
        Loader(COUNTING, 1, 8, seed=0).load_state_dict(state)


def test_builtin_corpus_and_byte_tokenizer():
    train, val, tokenizer = load_dataset()
    assert sum(map(len, train.shards)) + sum(map(len, val.shards)) == 1_115_394
    assert tokenizer.decode(tokenizer.encode("ROMEO: ¿qué?")) == "ROMEO: ¿qué?"
    assert bytes(train.shards[0][:14]).decode() == "First Citizen:"


def test_bpe_tokenizer_from_a_local_file(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], show_progress=False
    )
    bpe.train_from_iterator([TEXT], trainer)
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text(TEXT)
    meta = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    assert meta["tokenizer"] == "tokenizer.json" and (tmp_path / "out" / "tokenizer.json").is_file()
    assert meta["eot_id"] == 0  # the tokenizer's own <|endoftext|>
    train, val, tokenizer = load_dataset(tmp_path / "out")
    ids = np.concatenate(train.shards + val.shards).tolist()
    assert ids.count(0) == 2 and ids[-1] == 0  # after the train part and after the val part
    text = TEXT.encode()
    assert len(ids) < len(TEXT) and tokenizer.decode(ids) == "<|endoftext|>".join(
        [text[: _cut(text)].decode(), text[_cut(text) :].decode(), ""]
    )


def _bpe(tmp_path, special_tokens=("<|endoftext|>",)):
    """A small byte-level BPE tokenizer.json trained here (nothing downloaded)."""
    tokenizers = pytest.importorskip("tokenizers")
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(special_tokens), show_progress=False
    )
    bpe.train_from_iterator([TEXT], trainer)
    path = tmp_path / "tokenizer.json"
    bpe.save(str(path))
    return path


def _corpus(root):
    """Text files and JSON Lines in nested directories, a hidden file that must be skipped."""
    (root / "books" / "deep").mkdir(parents=True)
    (root / "books" / "a.txt").write_text(TEXT)
    (root / "books" / "deep" / "b.txt").write_text("Ünïcödé line\n" * 200 + "no newline at the end")
    (root / "books" / ".hidden").write_bytes(b"\0\1\2 not text")
    lines = [json.dumps({"id": i, "body": f"document {i}: " + "words " * (i % 7)}) for i in range(300)]
    (root / "web.jsonl").write_text("\n".join(lines[:150]) + "\n\n" + "\n".join(lines[150:]) + "\n")
    return [str(root / "books"), str(root / "*.jsonl")]


def test_prepare_takes_directories_globs_and_json_lines(tmp_path):
    inputs = _corpus(tmp_path)
    meta = prepare(inputs, tmp_path / "out", text_field="body")
    assert meta["documents"] == 2 * 2 + 300  # each text file's train and val parts, each JSON line
    train, val, tokenizer = load_dataset(tmp_path / "out")
    splits = [
        tokenizer.decode(np.concatenate(s.shards).tolist()).split("<|endoftext|>") for s in (train, val)
    ]
    assert splits[0][-1] == splits[1][-1] == ""  # the last document ends with its own end-of-text token
    # Sorted: books/a.txt, books/deep/b.txt (books/.hidden skipped), then web.jsonl's lines.
    documents = [t + v for t, v in zip(splits[0][:2], splits[1][:2], strict=True)] + splits[0][2:-1]
    documents += splits[1][2:-1]
    assert documents[:2] == [TEXT, "Ünïcödé line\n" * 200 + "no newline at the end"]
    assert documents[2:] == [f"document {i}: " + "words " * (i % 7) for i in range(300)]
    with pytest.raises(ValueError, match=r"web.jsonl line 1: no 'text' field \(its keys: id, body\)"):
        prepare([tmp_path / "web.jsonl"], tmp_path / "out2")
    with pytest.raises(FileNotFoundError, match="INPUT .*nowhere.txt: no such file"):
        prepare([tmp_path / "nowhere.txt"], tmp_path / "out2")
    with pytest.raises(ValueError, match=r"INPUT .*\*.parquet: no files there"):
        prepare([str(tmp_path / "*.parquet")], tmp_path / "out2")


@pytest.mark.parametrize("tokenizer", ["bytes", "bpe"])
def test_output_is_byte_identical_for_any_number_of_workers(tmp_path, tokenizer):
    inputs = _corpus(tmp_path)
    bpe = _bpe(tmp_path) if tokenizer == "bpe" else None
    outputs = []
    for workers in (1, 2, 3):
        out = tmp_path / f"out{workers}"
        prepare(inputs, out, bpe, text_field="body", workers=workers, piece_bytes=500, shard_tokens=700)
        outputs.append({f.name: f.read_bytes() for f in sorted(out.iterdir()) if f.name != "meta.json"})
        outputs[-1]["meta"] = json.loads((out / "meta.json").read_text()) | {"seconds": None}
    assert len(outputs[0]) > 10  # many shards, from pieces of 500 bytes
    assert outputs[1] == outputs[0] and outputs[2] == outputs[0]


@pytest.mark.parametrize("workers", [1, 2])
def test_pieces_are_read_as_they_are_tokenised_not_ahead(tmp_path, workers):
    """Memory stays a few pieces' whatever the corpus: the reader is at most 2 · workers pieces ahead."""
    (tmp_path / "big.txt").write_text("a line of text\n" * 2000)
    read = []

    def pieces():
        for piece in data.file_pieces(tmp_path / "big.txt", 0.1, piece_bytes=300):
            read.append(piece)
            yield piece

    ahead = []
    for i, (piece, tokens, _) in enumerate(
        data.encode_pieces(pieces(), ByteTokenizer(True), None, "text", workers)
    ):
        assert piece is read[i] and bytes(tokens[: len(piece.data)].astype(np.uint8)) == piece.data
        ahead.append(len(read) - i)
    assert len(read) > 90 and max(ahead) <= 2 * workers


def test_memory_is_bounded_by_a_piece_not_the_corpus(tmp_path):
    tracemalloc = pytest.importorskip("tracemalloc")
    (tmp_path / "big.txt").write_text("a line of text, repeated until the file holds 8 MB\n" * 160_000)
    tracemalloc.start()
    try:
        meta = prepare([tmp_path / "big.txt"], tmp_path / "out", piece_bytes=1 << 16, shard_tokens=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert sum(e["tokens"] for e in meta["train"] + meta["val"]) > 8e6
    assert peak < 2e6  # the whole corpus's tokens would take 16 MB as uint16, 64 MB as int64


def test_bad_input_names_the_file_and_line(tmp_path):
    good = "fine\n" * 100
    (tmp_path / "nul.txt").write_bytes(good.encode() * 2 + b"bad\0line\n")
    (tmp_path / "latin1.txt").write_bytes(good.encode() + "caf\xe9\n".encode("latin-1"))
    (tmp_path / "docs.jsonl").write_text('{"text": "a"}\n' * 60 + '{"title": "b"}\n')
    (tmp_path / "notjson.jsonl").write_text('{"text": "a"}\n{"text": oops}\n')
    (tmp_path / "number.jsonl").write_text('{"text": 3}\n')
    cases = {
        "nul.txt": r"nul.txt line 201: a NUL byte: not a text file",
        "latin1.txt": r"latin1.txt line 101: byte 0xe9 is not UTF-8: not a text file",
        "docs.jsonl": r"docs.jsonl line 61: no 'text' field \(its keys: title\)",
        "notjson.jsonl": r"notjson.jsonl line 2: not JSON",
        "number.jsonl": r"number.jsonl line 1: field 'text' is a int, not a string",
    }
    for name, message in cases.items():
        for workers in (1, 2):
            with pytest.raises(ValueError, match=message):
                prepare([tmp_path / name], tmp_path / "out", workers=workers, piece_bytes=64)
            assert not list((tmp_path / "out").iterdir())  # nothing left behind


def test_an_interrupted_run_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    (tmp_path / "in.txt").write_text(TEXT * 20)
    out = tmp_path / "out"
    prepare([tmp_path / "in.txt"], out, shard_tokens=5000)
    assert (out / "meta.json").is_file()
    encode, calls = data.encode_piece, []

    def interrupted(*args):
        calls.append(1)
        if len(calls) == 30:
            raise KeyboardInterrupt
        return encode(*args)

    monkeypatch.setattr(data, "encode_piece", interrupted)
    with pytest.raises(KeyboardInterrupt):
        prepare([tmp_path / "in.txt"], out, shard_tokens=5000, piece_bytes=1000)
    assert not list(out.iterdir())  # the earlier meta.json and shards went first, this run's after
    with pytest.raises(FileNotFoundError, match="no meta.json"):
        load_dataset(out)
    # A run killed outright leaves its open shard as .tmp: never a name the loader reads.
    writer = data.ShardWriter(out, "train", 257, shard_tokens=100)
    writer.write(np.arange(150))
    assert sorted(f.name for f in out.iterdir()) == ["train_000.bin", "train_001.bin.tmp"]
    assert read_shard(out / "train_000.bin")[0].tolist() == list(range(100))


def test_tokenizers_end_of_text_and_a_tokenizer_json_that_does_not_parse(tmp_path):
    (tmp_path / "in.txt").write_text(TEXT)
    with pytest.raises(ValueError, match=r"tokenizer.json: no end-of-text token .*<\|endoftext\|>"):
        prepare([tmp_path / "in.txt"], tmp_path / "out", _bpe(tmp_path, special_tokens=()))
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    bad = tmp_path / "tokenizer.json"
    for load in (lambda: data.load_tokenizer(tmp_path, "tokenizer.json"),
                 lambda: prepare([tmp_path / "in.txt"], tmp_path / "out", bad)):  # fmt: skip
        with pytest.raises(
            ValueError, match=f"{tmp_path / 'tokenizer.json'}: not a tokenizers tokenizer.json"
        ):
            load()
    assert ByteTokenizer(eot=True).decode([104, 105, 256, 195]) == "hi<|endoftext|>\ufffd"


def test_prepare_command_line_progress_and_summary(tmp_path, capsys):
    _corpus(tmp_path)
    data.main(["prepare", str(tmp_path / "books"), "--out", str(tmp_path / "out"), "--workers", "2"])
    out = capsys.readouterr().out
    assert "4 documents" in out and "tokens/s, 2 worker(s)); peak memory" in out
    assert "tokenizer bytes+eot, vocabulary 257, end of text 256" in out
    prepare([tmp_path / "books"], tmp_path / "out", progress=True)
    assert "tokens/s" in capsys.readouterr().err  # the bar's
    with pytest.raises(SystemExit):
        data.main(["prepare", str(tmp_path / "books"), "--out", str(tmp_path / "out"), "--workers", "0"])
    assert "--workers: must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        data.main(["prepare", str(tmp_path / "web.jsonl"), "--out", str(tmp_path / "out")])
    assert "web.jsonl line 1: no 'text' field" in capsys.readouterr().err


def test_a_resume_at_another_global_batch_says_what_changed(tmp_path, capsys):
    small = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32}
    quick = dict(
        max_steps=2, eval_interval=10, eval_tokens=64, sample_tokens=0, device="cpu", batch_tokens=None
    )
    cfg = train.TrainConfig(out_dir=str(tmp_path / "run"), batch_size=4, **quick)
    train.train(cfg, small)
    capsys.readouterr()
    train.train(dataclasses.replace(cfg, resume=True, max_steps=3, batch_size=2, grad_accum=2), small)
    assert "data: the global batch" not in capsys.readouterr().out  # 2 x 2 windows a step, as 4 x 1
    train.train(dataclasses.replace(cfg, resume=True, max_steps=4, batch_size=8), small)
    out = capsys.readouterr().out
    assert (
        "data: the global batch is now 8 windows (dp 1 x batch 8 x grad_accum 1), the checkpoint's 4 (dp 1 "
        "x batch 2 x grad_accum 2): the stream goes on from window 12 of epoch 0, none skipped or repeated"
    ) in out


def test_inspect_counts_documents_and_the_windows_that_cross_them(tmp_path, capsys):
    eot = 256
    tokens = np.array([1, 2, eot, 3, eot, 4, 5, 6, 7, eot, 8, 9], dtype=np.uint16)
    split = Split("two shards", [tokens[:4], tokens[4:]], 257)
    # Documents of 3, 2, 5 and 2 (the tail after the last end of text) tokens; windows of 4 tokens at
    # a stride of 3: [1 2 eot 3] and [3 eot 4 5] hold two documents, [5 6 7 eot] one.
    assert data.split_stats(split, eot, seq_len=3) == data.SplitStats(4, 12, 5, 2.5, 3, 2)
    assert data.split_stats(split, None, seq_len=3) == data.SplitStats(1, 12, 12, 12.0, 3, 0)
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in range(1, 41)))
    prepare([tmp_path / "in.jsonl"], tmp_path / "data", val_fraction=0.1)
    data.main(["inspect", str(tmp_path / "data"), "--seq-len", "16"])
    out = capsys.readouterr().out.splitlines()
    stats = data.inspect(tmp_path / "data", 16)
    # 40 documents of 1 ... 40 bytes and an end of text each, the val split cut between two of them.
    assert sum(s.documents for s in stats.values()) == 40 and sum(s.tokens for s in stats.values()) == 860
    train = stats["train"]
    assert out[0] == (
        f"train: {train.documents} documents, {train.tokens} tokens; longest document {train.longest} "
        f"tokens, median {train.median:.0f}; {train.windows} windows at --seq-len 16, "
        f"{train.windows_crossing / train.windows:.1%} of them crossing a document boundary"
    )
    assert out[1].startswith(f"val: {stats['val'].documents} documents")


def test_a_mixture_draws_each_source_at_its_weight_and_resumes_at_another_layout():
    web = Split("web", [np.arange(0, 4001, dtype=np.uint32)], 10_000)  # windows of 8: 500
    books = Split("books", [np.arange(5000, 5801, dtype=np.uint32)], 10_000)  # 100 windows
    splits, weights = {"web": web, "books": books}, {"web": 0.7, "books": 0.3}
    mixture = data.Mixture(splits, weights, 100, SEQ_LEN, seed=3)
    draws = torch.cat([mixture.next()[0] for _ in range(20)])  # 2,000 windows
    from_books = int((draws[:, 0] >= 5000).sum())
    sigma = (2000 * 0.3 * 0.7) ** 0.5
    assert abs(from_books - 600) <= 3 * sigma  # a binomial's 3-sigma band: 600 ± 61
    # Each source walks its own epochs without replacement: books went round about 6 times.
    books_windows = ((draws[:, 0][draws[:, 0] >= 5000] - 5000) // SEQ_LEN).tolist()
    assert sorted(books_windows[:100]) == list(range(100))
    assert mixture.epochs == {"web": (2000 - from_books) / 500, "books": from_books / 100}

    # dp 2 x 25 x grad_accum 2 draws the same stream as 1 x 100; a resume at dp 4 x 10 goes on from it.
    ranks = [
        data.Mixture(splits, weights, 25, SEQ_LEN, seed=3, dp_rank=r, dp_size=2, grad_accum=2) for r in (0, 1)
    ]
    stream = torch.cat([torch.cat([r.next()[0] for r in ranks]) for _ in range(20)])
    assert torch.equal(stream[:, 0], draws[:, 0][:1000])
    resumed = [data.Mixture(splits, weights, 10, SEQ_LEN, seed=3, dp_rank=r, dp_size=4) for r in range(4)]
    for r in resumed:
        r.load_state_dict(ranks[0].state_dict())
    assert (
        "the global batch is now 40 windows" in resumed[0].layout_change
        and "from draw 1,000" in resumed[0].layout_change
    )
    rest = torch.cat([torch.cat([r.next()[0] for r in resumed]) for _ in range(25)])
    assert torch.equal(rest[:, 0], draws[:, 0][1000:])


def test_mixture_flags_and_a_training_run_on_two_sources(tmp_path, capsys):
    assert data.parse_mixture("data/web=0.7,data/books=0.3") == {"data/web": 0.7, "data/books": 0.3}
    assert data.parse_mixture("data/web") is None
    (tmp_path / "mix.toml").write_text('"data/web" = 2\n"data/books" = 1\n')
    assert data.parse_mixture(str(tmp_path / "mix.toml")) == {"data/web": 2.0, "data/books": 1.0}
    with pytest.raises(ValueError, match="'web' is not DIR=WEIGHT"):
        data.parse_mixture("a=1,web")
    with pytest.raises(ValueError, match="weights > 0"):
        data.parse_mixture("a=1,b=0")
    text = data.builtin_text()
    for name, part in (("web", text[:40_000]), ("books", text[40_000:80_000])):
        (tmp_path / f"{name}.txt").write_text(part)
        prepare([tmp_path / f"{name}.txt"], tmp_path / name)
    mixture = f"{tmp_path / 'web'}=0.7,{tmp_path / 'books'}=0.3"
    small = {"n_layer": 1, "d_model": 32, "n_head": 2, "block_size": 32}
    quick = dict(batch_size=4, max_steps=2, eval_interval=2, eval_tokens=64, sample_tokens=0, device="cpu")
    records = train.train(train.TrainConfig(data=mixture, out_dir=str(tmp_path / "run"), **quick), small)
    losses = records[-1]["val_loss_by_source"]
    assert records[-1]["val_loss"] == pytest.approx(
        0.7 * losses[str(tmp_path / "web")] + 0.3 * losses[str(tmp_path / "books")]
    )
    out = capsys.readouterr().out
    assert f"data mixture {tmp_path / 'web'} 0.7, {tmp_path / 'books'} 0.3 (train)" in out
    assert f"({tmp_path / 'web'} {losses[str(tmp_path / 'web')]:.4f}, epoch 0.0" in out
