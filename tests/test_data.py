"""horse.data: shards round-trip, bad shards fail loudly, and the loader is deterministic, resumable and
splits the global batch over data-parallel replicas."""

import json

import numpy as np
import pytest
import torch

from horse import data
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


def test_prepare_round_trips_bytes_into_shards(prepared):
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 256
    assert len(meta["train"]) > 1  # 1,000-token shards
    train, val, tokenizer = load_dataset(prepared)
    assert isinstance(tokenizer, ByteTokenizer)
    assert all(s.dtype == np.uint16 for s in train.shards)
    a, b = TEXT.encode(), ("All:\nSpeak, speak. Ünïcödé\n" * 30).encode()
    n_a, n_b = len(a) - len(a) // 10, len(b) - len(b) // 10
    assert bytes(np.concatenate(train.shards).astype(np.uint8)) == a[:n_a] + b[:n_b]
    assert bytes(np.concatenate(val.shards).astype(np.uint8)) == a[n_a:] + b[n_b:]


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
    with pytest.raises(ValueError, match="meta.json lists 1,000 of 256"):
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
    resumed.load_state_dict(Loader(train, 4, 32, seed=7).state_dict() | {"position": 3})
    assert torch.equal(resumed.next()[0], batches[3][0])
    assert not torch.equal(Loader(train, 4, 32, seed=8).next()[0], batches[0][0])


def test_data_parallel_replicas_read_disjoint_slices_of_the_global_batch():
    train, _, _ = load_dataset()
    whole = Loader(train, 6, 32, seed=7)
    replicas = [Loader(train, 2, 32, seed=7, dp_rank=r, dp_size=3) for r in range(3)]
    replicas[1].load_state_dict(replicas[0].state_dict() | {"position": 2})  # resumable like one loader
    whole.position, replicas[0].position, replicas[2].position = 2, 2, 2
    x, y = whole.next()
    parts = [r.next() for r in replicas]
    assert torch.equal(torch.cat([p[0] for p in parts]), x) and torch.equal(
        torch.cat([p[1] for p in parts]), y
    )
    assert not torch.equal(parts[0][0], parts[1][0])
    with pytest.raises(ValueError, match="dp_rank 3 must be in \\[0, dp_size 3\\)"):
        Loader(train, 2, 32, seed=7, dp_rank=3, dp_size=3)


def test_windows_never_cross_a_shard_boundary():
    split = Split("two shards", [np.full(20, 1, dtype=np.uint16), np.full(50, 2, dtype=np.uint16)], 256)
    loader = Loader(split, 64, 10, seed=0)
    x, y = loader.next()
    rows = torch.cat([x, y[:, -1:]], dim=1)
    assert all(len(set(row.tolist())) == 1 for row in rows)
    assert {row[0].item() for row in rows} == {1, 2}
    with pytest.raises(ValueError, match="no shard holds seq_len \\+ 1 = 51 tokens"):
        Loader(split, 1, 50, seed=0)


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
    bpe.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(vocab_size=300, show_progress=False))
    bpe.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "in.txt").write_text(TEXT)
    meta = prepare([tmp_path / "in.txt"], tmp_path / "out", tokenizer=tmp_path / "tokenizer.json")
    assert meta["tokenizer"] == "tokenizer.json" and (tmp_path / "out" / "tokenizer.json").is_file()
    train, val, tokenizer = load_dataset(tmp_path / "out")
    ids = np.concatenate(train.shards + val.shards).tolist()
    assert len(ids) < len(TEXT) and tokenizer.decode(ids) == TEXT
