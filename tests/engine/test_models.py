"""Tests for engine.models: shapes, sizes, determinism, no buffers, and a learning step."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.models import MODEL_NAMES, CharLSTM, build_model, num_parameters

VOCAB = 80
SEQ_LEN = 80

# (name, natural input_shape, num_classes)
CASES: list[tuple[str, tuple[int, ...], int]] = [
    ("logreg", (1, 28, 28), 10),
    ("mlp", (1, 28, 28), 10),
    ("cnn", (1, 28, 28), 62),
    ("cnn", (3, 32, 32), 10),
    ("resnet10_gn", (3, 32, 32), 10),
    ("resnet18_gn", (3, 32, 32), 100),
    ("char_lstm", (SEQ_LEN,), VOCAB),
]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _batch(input_shape: tuple[int, ...], num_classes: int, n: int, seed: int = 0) -> torch.Tensor:
    g = _gen(seed)
    if len(input_shape) == 1:  # token ids
        return torch.randint(0, num_classes, (n, *input_shape), generator=g)
    return torch.randn((n, *input_shape), generator=g)


def _batch_size(name: str) -> int:
    return 2 if name.startswith("resnet") else 4


def test_cases_cover_every_model() -> None:
    assert {name for name, _, _ in CASES} == set(MODEL_NAMES)


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), CASES)
def test_forward_shape(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    model = build_model(name, input_shape, num_classes, _gen(0))
    n = _batch_size(name)
    out = model(_batch(input_shape, num_classes, n))
    assert out.shape == (n, num_classes)
    assert out.dtype == torch.float32
    assert torch.isfinite(out).all()


def test_cnn_parameter_count_matches_fedavg() -> None:
    model = build_model("cnn", (1, 28, 28), 10, _gen(0))
    assert num_parameters(model) == 1_663_370


def test_num_parameters_counts_only_trainable() -> None:
    model = build_model("logreg", (1, 28, 28), 10, _gen(0))
    assert num_parameters(model) == 784 * 10 + 10
    model[1].bias.requires_grad_(False)
    assert num_parameters(model) == 784 * 10


def test_mlp_architecture() -> None:
    model = build_model("mlp", (1, 28, 28), 10, _gen(0))
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert [(m.in_features, m.out_features) for m in linears] == [
        (784, 200),
        (200, 200),
        (200, 10),
    ]


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), CASES)
def test_deterministic_given_generator(
    name: str, input_shape: tuple[int, ...], num_classes: int
) -> None:
    a = build_model(name, input_shape, num_classes, _gen(123))
    b = build_model(name, input_shape, num_classes, _gen(123))
    c = build_model(name, input_shape, num_classes, _gen(124))
    pa, pb, pc = (list(m.parameters()) for m in (a, b, c))
    assert len(pa) == len(pb) == len(pc) > 0
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))
    assert not all(torch.equal(x, z) for x, z in zip(pa, pc, strict=True))


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), CASES)
def test_global_rng_untouched(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    torch.manual_seed(7)
    state = torch.get_rng_state()
    build_model(name, input_shape, num_classes, _gen(0))
    assert torch.equal(torch.get_rng_state(), state)


def test_generator_advances_so_successive_builds_differ() -> None:
    g = _gen(5)
    a = build_model("logreg", (1, 28, 28), 10, g)
    b = build_model("logreg", (1, 28, 28), 10, g)
    assert not torch.equal(a[1].weight, b[1].weight)


def test_without_generator_uses_global_rng() -> None:
    torch.manual_seed(11)
    a = build_model("logreg", (1, 28, 28), 10)
    torch.manual_seed(11)
    b = build_model("logreg", (1, 28, 28), 10)
    assert torch.equal(a[1].weight, b[1].weight)


@pytest.mark.parametrize(("name", "input_shape", "num_classes"), CASES)
def test_no_buffers(name: str, input_shape: tuple[int, ...], num_classes: int) -> None:
    model = build_model(name, input_shape, num_classes, _gen(0))
    assert list(model.buffers()) == []
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("name", ["resnet10_gn", "resnet18_gn"])
def test_resnet_uses_groupnorm_not_batchnorm(name: str) -> None:
    model = build_model(name, (3, 32, 32), 10, _gen(0))
    gns = [m for m in model.modules() if isinstance(m, nn.GroupNorm)]
    assert gns and all(m.num_groups == 2 for m in gns)
    assert not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def test_resnet_depths_differ() -> None:
    r10 = build_model("resnet10_gn", (3, 32, 32), 10, _gen(0))
    r18 = build_model("resnet18_gn", (3, 32, 32), 10, _gen(0))
    assert [len(r10.get_submodule(f"layer{i}")) for i in range(1, 5)] == [1, 1, 1, 1]
    assert [len(r18.get_submodule(f"layer{i}")) for i in range(1, 5)] == [2, 2, 2, 2]
    assert num_parameters(r10) < num_parameters(r18)


def test_resnet_small_input_stem_and_grey_channels() -> None:
    model = build_model("resnet10_gn", (1, 28, 28), 10, _gen(0))
    assert model.conv1.in_channels == 1
    assert model.conv1.kernel_size == (3, 3) and model.conv1.stride == (1, 1)
    assert model.conv1.bias is None
    assert isinstance(model.maxpool, nn.Identity)
    assert model(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_resnet_large_input_keeps_imagenet_stem() -> None:
    model = build_model("resnet10_gn", (1, 96, 96), 7, _gen(0))
    assert model.conv1.in_channels == 1
    assert model.conv1.kernel_size == (7, 7) and model.conv1.stride == (2, 2)
    assert isinstance(model.maxpool, nn.MaxPool2d)
    assert model(torch.randn(2, 1, 96, 96)).shape == (2, 7)


def test_char_lstm_architecture() -> None:
    model = build_model("char_lstm", (SEQ_LEN,), VOCAB, _gen(0))
    assert isinstance(model, CharLSTM)
    assert model.embedding.num_embeddings == VOCAB and model.embedding.embedding_dim == 8
    assert model.lstm.hidden_size == 256 and model.lstm.num_layers == 2
    assert model.lstm.batch_first
    assert (model.fc.in_features, model.fc.out_features) == (256, VOCAB)


def test_char_lstm_uses_last_time_step() -> None:
    model = build_model("char_lstm", (SEQ_LEN,), VOCAB, _gen(0)).eval()
    x = _batch((SEQ_LEN,), VOCAB, 4)
    with torch.no_grad():
        out = model(x)
        assert out.shape == (4, VOCAB)
        # Equals the head applied to the final LSTM output.
        seq, _ = model.lstm(model.embedding(x))
        torch.testing.assert_close(out, model.fc(seq[:, -1, :]))
        # Each row depends only on its own sequence.
        torch.testing.assert_close(model(x[:1]), out[:1])
        # The whole sequence is read: changing only the first token changes the prediction.
        # (Short sequence: at initialisation the LSTM forgets the first token within ~20 steps.)
        short = x[:, :5]
        changed = short.clone()
        changed[:, 0] = (changed[:, 0] + 1) % VOCAB
        out_short, out_changed = model(short), model(changed)
        assert out_changed.shape == (4, VOCAB)
        assert (out_short - out_changed).abs().max() > 1e-4
        # Changing the first token of a long sequence matters far less than changing the
        # last one, as it should when the head reads the last time step.
        first, last = x.clone(), x.clone()
        first[:, 0] = (first[:, 0] + 1) % VOCAB
        last[:, -1] = (last[:, -1] + 1) % VOCAB
        d_first = (model(first) - out).abs().max()
        d_last = (model(last) - out).abs().max()
        assert d_last > 1e-4
        assert d_last > 100 * d_first


def test_logreg_sgd_step_reduces_loss() -> None:
    model = build_model("logreg", (1, 28, 28), 10, _gen(0))
    x = _batch((1, 28, 28), 10, 32, seed=1)
    y = torch.randint(0, 10, (32,), generator=_gen(2))
    loss_fn = nn.CrossEntropyLoss()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = loss_fn(model(x), y)
    opt.zero_grad()
    before.backward()
    opt.step()
    with torch.no_grad():
        after = loss_fn(model(x), y)
    assert after.item() < before.item()


def test_unknown_name_raises() -> None:
    with pytest.raises(ValueError, match=r"model\.name=vgg16 is not one of"):
        build_model("vgg16", (3, 32, 32), 10)


@pytest.mark.parametrize(
    ("name", "input_shape"),
    [("cnn", (784,)), ("resnet10_gn", (28, 28)), ("char_lstm", (1, 28, 28))],
)
def test_bad_input_shape_raises(name: str, input_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=f"model.name={name}"):
        build_model(name, input_shape, 10)


def test_bad_num_classes_raises() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        build_model("logreg", (4,), 0)
