"""horse.hf: Hugging Face GPT-2 and LLaMA checkpoints in (hf.from_pretrained) and out (checkpoint
export --format hf), against transformers' own models built from random configs (nothing downloaded):
the same logits within 1e-4 in float32, the same greedy generations token for token."""

import json

import pytest
import torch
from helpers import assert_close
from safetensors.torch import load_file, save_file

from horse import checkpoint, cli, generate, hf, kernels, train
from horse.hf import weights
from horse.model import GPT, GPTConfig
from horse.parallel import Parallel, materialize, parallelize, shard, shard_spec, shard_state_dict
from horse.train import TrainConfig

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 4


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every parameter (norm weights and biases too) away from its initial value."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.05)


def hf_gpt2(vocab: int = 101, tie: bool = True) -> torch.nn.Module:
    config = transformers.GPT2Config(
        vocab_size=vocab,
        n_positions=48,
        n_embd=32,
        n_layer=2,
        n_head=4,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=tie,
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).eval()
    _randomize(model, 1)
    return model


def hf_llama(tie: bool = False, bias: bool = False) -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=48, rope_theta=500.0, rms_norm_eps=1e-6,
        tie_word_embeddings=tie, attention_bias=bias, bos_token_id=None, eos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).eval()
    _randomize(model, 2)
    return model


def save_hf(model, path, fmt: str):
    """model saved by save_pretrained (safetensors, or sharded), or as a pytorch_model.bin: GPT-2's
    of its bare GPT2Model (no "transformer." in the names, as OpenAI's GPT-2 on the Hub)."""
    if fmt == "bin":
        model.config.save_pretrained(path)
        gpt2 = isinstance(model, transformers.GPT2LMHeadModel)
        torch.save((model.transformer if gpt2 else model).state_dict(), path / hf.BIN)
    else:
        model.save_pretrained(path, **({"max_shard_size": "20KB"} if fmt == "sharded" else {}))
    return path


def bpe_tokenizer(path):
    bpe = tokenizers.Tokenizer(tokenizers.models.BPE())
    bpe.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = tokenizers.decoders.ByteLevel()
    bpe.train_from_iterator([TEXT], tokenizers.trainers.BpeTrainer(vocab_size=300, show_progress=False))
    bpe.save(str(path))
    return bpe


def _ids(vocab: int, shape=(2, 40), seed: int = 3) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))


def assert_same_logits(ours: GPT, theirs, vocab: int) -> None:
    idx = _ids(vocab)
    with torch.no_grad():
        expected = theirs(idx).logits
        logits = ours(idx)
    torch.testing.assert_close(logits[..., :vocab], expected, atol=1e-4, rtol=0)
    assert (logits[..., vocab:] == float("-inf")).all()  # the padding rows


def assert_same_greedy(ours: GPT, theirs, vocab: int, new_tokens: int = 24) -> None:
    prompt = _ids(vocab, (2, 5), seed=4)
    out = generate.generate(ours, prompt, new_tokens, temperature=0)
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
        do_sample=False, pad_token_id=0,
    )  # fmt: skip
    assert out.tolist() == expected.tolist()


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_from_pretrained_matches_transformers(tmp_path, arch, fmt):
    theirs = hf_gpt2() if arch == "gpt2" else hf_llama()
    path = save_hf(theirs, tmp_path / "hf", fmt)
    if fmt == "sharded":
        assert (path / hf.SAFETENSORS_INDEX).is_file()
    ours = hf.from_pretrained(path).eval()
    vocab = theirs.config.vocab_size
    assert ours.config.vocab_size % 64 == 0 and ours.config.vocab_used == vocab  # 101 -> 128, 97 -> 128
    if arch == "llama":
        assert (ours.config.n_head, ours.config.kv_heads, ours.config.rope_base) == (4, 2, 500.0)
        assert ours.lm_head is not None
    assert_same_logits(ours, theirs, vocab)
    assert_same_greedy(ours, theirs, vocab)


@pytest.mark.parametrize("tie, bias", [(True, True), (False, False)])
def test_llama_tied_head_and_attention_biases(tmp_path, tie, bias):
    theirs = hf_llama(tie=tie, bias=bias)
    ours = hf.from_pretrained(save_hf(theirs, tmp_path / "hf", "safetensors")).eval()
    assert (ours.lm_head is None, ours.config.bias) == (tie, bias)
    assert_same_logits(ours, theirs, theirs.config.vocab_size)


def test_padding_gets_no_probability_in_the_loss_and_is_never_sampled(tmp_path):
    ours = hf.from_pretrained(save_hf(hf_gpt2(), tmp_path / "hf", "safetensors"))
    idx, targets = _ids(101), _ids(101, seed=5)
    loss = ours.loss(idx, targets)
    expected = torch.nn.functional.cross_entropy(ours(idx)[..., :101].flatten(0, 1), targets.flatten())
    torch.testing.assert_close(loss, expected)
    loss.backward()
    assert ours.wte.weight.grad[101:].abs().max() == 0  # no gradient reaches the padding rows
    with torch.no_grad():  # the padding rows made the likeliest: still never picked
        ours.wte.weight[101:] = ours.wte.weight[:101].sum(0) * 100
    out = generate.generate(ours, idx[:, :3], 30, temperature=2.0, generator=torch.Generator().manual_seed(0))
    assert out.max() < 101


def _horse_checkpoint(tmp_path, config: GPTConfig, tokenizer_file=None):
    """A horse training run's checkpoint of a random model of config."""
    torch.manual_seed(6)
    model = GPT(config)
    _randomize(model, 7)
    optimizer = torch.optim.AdamW(model.parameters())
    name = "tokenizer.json" if tokenizer_file else "bytes"
    checkpoint.save(tmp_path / "run", 1, model, optimizer, {}, name, tokenizer_file)
    return model.eval(), tmp_path / "run"


HORSE_GPT2 = GPTConfig(vocab_size=320, vocab_used=300, block_size=48, n_layer=2, n_head=4, d_model=32)
HORSE_LLAMA = GPTConfig(
    vocab_size=320, vocab_used=300, block_size=48, n_layer=2, n_head=4, n_kv_heads=2, d_model=32,
    mlp_hidden=40, positions="rotary", norm="rmsnorm", mlp="swiglu", bias=False, rope_base=300.0,
    norm_eps=1e-6, tie_embeddings=False,
)  # fmt: skip


@pytest.mark.parametrize("config", [HORSE_GPT2, HORSE_LLAMA], ids=["gpt2", "llama"])
def test_export_loads_in_transformers_with_the_same_logits(tmp_path, config, capsys):
    bpe_tokenizer(tmp_path / "tokenizer.json")
    ours, run = _horse_checkpoint(tmp_path, config, tmp_path / "tokenizer.json")
    out = tmp_path / "export"
    weights.main(["export", str(run), "--format", "hf", "--out", str(out)])
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    expected = "GPT2LMHeadModel" if config.positions == "learned" else "LlamaForCausalLM"
    assert type(theirs).__name__ == expected and theirs.config.vocab_size == 300
    assert_same_logits(ours, theirs, 300)
    assert_same_greedy(ours, theirs, 300)
    back = hf.from_pretrained(out)  # and in again: the same model
    assert back.config == config
    for name, t in ours.state_dict().items():
        rows = 300 if name in ("wte.weight", "lm_head.weight") else None  # the padding rows are not exported
        torch.testing.assert_close(back.state_dict()[name][:rows], t[:rows], atol=0, rtol=0)

    capsys.readouterr()
    generate.main(["--ckpt", str(out), "--prompt", "To be", "--max-new-tokens", "5", "--temperature", "0"])
    assert capsys.readouterr().out.startswith("To be")


def test_export_of_an_untied_gpt2_without_biases(tmp_path):
    config = GPTConfig(
        vocab_size=256,
        block_size=48,
        n_layer=1,
        n_head=2,
        n_kv_heads=2,
        d_model=16,
        bias=False,
        tie_embeddings=False,
    )
    ours, run = _horse_checkpoint(tmp_path, config)
    hf.export(run, tmp_path / "export")
    assert not (tmp_path / "export" / "tokenizer.json").exists()
    theirs = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "export").eval()
    assert_same_logits(ours, theirs, 256)


def test_export_of_a_model_without_a_twin_names_the_fields(tmp_path):
    config = GPTConfig(vocab_size=256, block_size=32, n_layer=1, n_head=2, d_model=16, positions="rotary")
    _, run = _horse_checkpoint(tmp_path, config)
    with pytest.raises(SystemExit):
        weights.main(["export", str(run), "--format", "hf", "--out", str(tmp_path / "export")])
    with pytest.raises(ValueError, match="'positions': 'rotary', 'norm': 'layernorm', 'mlp': 'gelu'"):
        hf.export(run, tmp_path / "export")
    assert not (tmp_path / "export" / "config.json").exists()


def test_generate_cli_with_a_hf_folder_and_its_tokenizer(tmp_path, capsys):
    bpe = bpe_tokenizer(tmp_path / "tokenizer.json")
    theirs = hf_gpt2(vocab=bpe.get_vocab_size())
    path = save_hf(theirs, tmp_path / "hf", "safetensors")
    (path / "tokenizer.json").write_text((tmp_path / "tokenizer.json").read_text())
    generate.main(["--ckpt", str(path), "--prompt", "To be", "--max-new-tokens", "8", "--temperature", "0"])
    text = capsys.readouterr().out
    prompt = torch.tensor([bpe.encode("To be").ids])
    expected = theirs.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False, pad_token_id=0
    )
    assert text == bpe.decode(expected[0].tolist()) + "\n"


def test_bad_checkpoints_name_the_file_and_what_was_expected(tmp_path, capsys):
    path = save_hf(hf_llama(), tmp_path / "hf", "safetensors")
    tensors = load_file(path / "model.safetensors")
    dropped = ("model.layers.1.self_attn.k_proj.weight", "lm_head.weight")
    save_file({k: v for k, v in tensors.items() if k not in dropped}, path / "model.safetensors")
    with pytest.raises(ValueError, match="2 tensor") as e:
        hf.from_pretrained(path)
    assert str(path) in str(e.value)
    assert "model.layers.1.self_attn.k_proj.weight" in str(e.value) and "lm_head.weight" in str(e.value)

    save_file(tensors, path / "model.safetensors")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"intermediate_size": 40}))
    wrong = r"up_proj.weight \(as blocks.0.mlp.up_proj.weight\): \[48, 32\], expected \[40, 32\]"
    with pytest.raises(ValueError, match=wrong):
        hf.from_pretrained(path)
    (path / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k != "hidden_size"}))
    with pytest.raises(ValueError, match="config.json: no 'hidden_size', which a LlamaForCausalLM config"):
        hf.from_pretrained(path)
    bert = {"architectures": ["BertModel"], "model_type": "bert"}
    (path / "config.json").write_text(json.dumps(config | bert))
    with pytest.raises(ValueError, match=r"config.json: architecture \['BertModel'\] is not supported") as e:
        hf.from_pretrained(path)
    assert "GPT2LMHeadModel" in str(e.value) and str(path) in str(e.value)

    (path / "config.json").write_text(json.dumps({"train": {}, "model": {}}))  # a horse run's
    with pytest.raises(ValueError, match="config.json: names no architectures or model_type"):
        hf.from_pretrained(path)

    yarns = ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, {"rope_parameters": {"rope_type": "yarn"}})
    for yarn in yarns:
        (path / "config.json").write_text(json.dumps(config | yarn))
        with pytest.raises(ValueError, match="rope_type 'yarn'; expected the default rotary"):
            hf.from_pretrained(path)

    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="no weights: expected model.safetensors"):
        hf.from_pretrained(path)

    save_hf(hf_gpt2(), path, "safetensors")
    (path / "tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit):
        generate.main(["--ckpt", str(path), "--max-new-tokens", "1"])
    assert f"{path / 'tokenizer.json'}: not a tokenizers tokenizer.json" in capsys.readouterr().err


def test_init_from_a_hf_folder_fine_tunes_its_weights(tmp_path, capsys):
    theirs = hf_llama()
    theirs.resize_token_embeddings(256)  # the built-in corpus is bytes
    path = save_hf(theirs, tmp_path / "hf", "safetensors")
    cfg = TrainConfig(
        init_from=str(path), out_dir=str(tmp_path / "run"), batch_size=2, seq_len=16, max_steps=1,
        lr=1e-12, warmup_steps=0, eval_interval=1, eval_tokens=64, sample_tokens=0, device="cpu",
    )  # fmt: skip
    train.train(cfg, {})
    assert f"model {path}:" in capsys.readouterr().out
    tuned = checkpoint.full_weights(checkpoint.latest(tmp_path / "run"))
    for name, t in hf.from_pretrained(path).state_dict().items():
        torch.testing.assert_close(tuned[name], t, atol=1e-9, rtol=0)  # one step at lr 1e-12
    train.train(*cli.parse_args(["--out-dir", cfg.out_dir, "--resume", "--max-steps", "2"]))
    assert checkpoint.latest(tmp_path / "run").name == "ckpt_0000002"  # resumed: the run's own weights
    train.train(TrainConfig(**(vars(cfg) | {"init_from": cfg.out_dir, "out_dir": f"{cfg.out_dir}2"})), {})
    again = checkpoint.full_weights(checkpoint.latest(tmp_path / "run2"))  # from a horse run this time
    for name, t in checkpoint.full_weights(checkpoint.latest(tmp_path / "run")).items():
        torch.testing.assert_close(again[name], t, atol=1e-9, rtol=0)
    with pytest.raises(ValueError, match="--n-layer 3 \\(its 2\\)"):
        train.train(cfg, {"n_layer": 3})
    small = save_hf(hf_gpt2(vocab=100), tmp_path / "small", "bin")
    with pytest.raises(ValueError, match=r"the data's vocabulary \(256\) is larger than the model's \(100\)"):
        train.train(TrainConfig(**(vars(cfg) | {"init_from": str(small)})), {})


def test_a_tiny_forward_through_the_triton_backend(tmp_path, monkeypatch):
    """In float32 (fused norms), and in float16, where attention and the gated MLP run the kernels too:
    within twice the reference backend's own float16 error of transformers' float32 logits."""
    theirs = hf_llama()
    path = save_hf(theirs, tmp_path / "hf", "safetensors")
    ours, reference = (hf.from_pretrained(path, backend=b).eval() for b in ("triton", "reference"))
    calls = []
    for name in ("flash_attention", "fused_gated_mlp"):  # the model looks them up at call time
        kernel = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _k=kernel, _n=name, **kw: calls.append(_n) or _k(*a, **kw)
        )
    idx = _ids(97, (1, 7))
    with torch.no_grad():
        truth = theirs(idx).logits
        torch.testing.assert_close(ours(idx)[..., :97], truth, atol=1e-4, rtol=0)
        with torch.autocast("cpu", torch.float16):
            logits, baseline = ours(idx)[..., :97], reference(idx)[..., :97]
    assert calls == ["flash_attention", "fused_gated_mlp"] * 2  # in float16 only, once a layer
    assert_close("float16 logits", logits, truth, baseline)


class _Counted:
    """A tensor or safetensors slice whose reads append their element counts to read."""

    def __init__(self, part, read: list[int]):
        self.part, self.read = part, read

    def get_shape(self):
        return self.part.get_shape()

    def __getitem__(self, index):
        values = self.part[index]
        self.read.append(values.numel())
        return values


def _sliced_shard(path, tp_rank: int, tp: int) -> dict[str, torch.Tensor]:
    """Rank tp_rank of tp's shard of the model of HF folder path, built on the meta device and its
    slices read from the folder (``weight_source``), as --init-from starts."""
    config = hf.pretrained_config(path)
    with torch.device("meta"):
        model = parallelize(GPT(config), Parallel(tp_rank=tp_rank, tp_size=tp))
    materialize(
        model, Parallel(tp_rank=tp_rank, tp_size=tp), "cpu", None, weights.weight_source(path, config)
    )
    return model.state_dict()


@pytest.mark.parametrize("fmt", ["safetensors", "sharded", "bin"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_a_rank_reads_its_slices_byte_equal_to_the_whole_load_cut(tmp_path, arch, fmt):
    """Every tp rank's shard read in slices (per q/k/v part, GPT-2's transposed Conv1D, the padded
    vocabulary's zero rows) is the whole load's (from_pretrained) cut by the plan, byte for byte."""
    theirs = hf_gpt2(vocab=124) if arch == "gpt2" else hf_llama(bias=True)
    path = save_hf(theirs, tmp_path, fmt)
    whole = hf.from_pretrained(path)
    for tp in (1, 2):
        for tp_rank in range(tp):
            expected = shard_state_dict(whole.state_dict(), whole.config, tp_rank, tp)
            for name, t in _sliced_shard(path, tp_rank, tp).items():
                assert torch.equal(t, expected[name]), (tp, tp_rank, name)


def test_a_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """At tp 2 the two ranks together ask the safetensors files for each stored element once (the
    replicated norms twice): a rank reads about its half, never a whole tensor to cut (counted by a
    spy on safe_open's slices)."""
    path = save_hf(hf_llama(), tmp_path, "sharded")
    stored = sum(t.numel() for f in path.glob("*.safetensors") for t in load_file(f).values())
    open_, read = weights.safe_open, []

    class Spy:
        def __init__(self, *args, **kwargs):
            self.file = open_(*args, **kwargs)

        def __enter__(self):
            self.file.__enter__()
            return self

        def __exit__(self, *exc):
            return self.file.__exit__(*exc)

        def keys(self):
            return self.file.keys()

        def get_slice(self, name):
            return _Counted(self.file.get_slice(name), read)

    monkeypatch.setattr(weights, "safe_open", Spy)
    replicated = sum(  # the norms: whole on every tp rank
        t.numel() for name, t in hf.from_pretrained(path).state_dict().items() if "norm" in name
    )
    per_rank = []
    for tp_rank in range(2):
        read.clear()
        _sliced_shard(path, tp_rank, 2)
        per_rank.append(sum(read))
    assert sum(per_rank) == stored + replicated, (per_rank, stored)
    assert max(per_rank) < 0.6 * stored, (per_rank, stored)


def test_a_bin_folder_above_the_limit_is_refused_with_the_conversion(tmp_path, monkeypatch):
    path = save_hf(hf_gpt2(), tmp_path, "bin")
    config = hf.pretrained_config(path)
    assert weights.weight_source(path, config)("wpe.weight", torch.arange(2), None).shape == (2, 32)
    monkeypatch.setattr(weights, "BIN_LIMIT", (path / hf.BIN).stat().st_size - 1)
    with pytest.raises(ValueError, match=r"which each host would read whole.*save_pretrained"):
        weights.weight_source(path, config)


def test_a_checkpoint_at_another_tp_size_is_read_in_the_rows_a_rank_holds(tmp_path, monkeypatch):
    """A tp 1 checkpoint restored at tp 2 (as resharding and --init-from read it): each rank's rows
    of the weights and AdamW's moments are the whole tensor's cut by the plan, and a rank reads only
    those rows (all their columns, for a tensor cut by columns), counted by a spy on the pieces."""
    theirs = hf_llama()
    theirs.resize_token_embeddings(256)  # the built-in corpus is bytes
    path = save_hf(theirs, tmp_path / "hf", "safetensors")
    cfg = TrainConfig(
        init_from=str(path), out_dir=str(tmp_path / "run"), batch_size=2, seq_len=16, max_steps=1,
        eval_interval=1, eval_tokens=32, sample_tokens=0, device="cpu",
    )  # fmt: skip
    train.train(cfg, {})
    pieces = checkpoint.Pieces(checkpoint.latest(tmp_path / "run"))
    piece, read = checkpoint.Pieces._piece, []
    monkeypatch.setattr(checkpoint.Pieces, "_piece", lambda *args: _Counted(piece(*args), read))
    for key in (None, "exp_avg"):
        for name in pieces.shapes:
            whole, spec = pieces.whole(name, key), shard_spec(name, pieces.config)
            for tp_rank in (0, 1):
                read.clear()
                mine = pieces.for_rank(name, key, tp_rank, 2, (1, 3))
                assert torch.equal(mine, shard(whole, spec, tp_rank, 2)[1:3]), (name, key, tp_rank)
                columns_cut = spec is not None and spec.dim == 1
                assert sum(read) == mine.numel() * (2 if columns_cut else 1), (name, key, read)
