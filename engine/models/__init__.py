"""Model zoo: the networks a federated run can train, built by name.

:func:`build_model` maps ``model.name`` to a freshly initialised :class:`torch.nn.Module`:

* ``logreg`` — multinomial logistic regression (flatten, one linear layer).
* ``mlp`` — the 2x200 ReLU MLP of McMahan et al. (2017).
* ``cnn`` — the FedAvg / EMNIST CNN of McMahan et al. (2017): two 5x5 conv layers (32 and 64
  channels, each followed by ReLU and 2x2 max-pooling), a 512-unit dense layer and a linear
  classifier. For ``(1, 28, 28)`` inputs and 10 classes it has 1,663,370 parameters.
* ``resnet10_gn`` / ``resnet18_gn`` — torchvision's ResNet with BasicBlocks (``[1, 1, 1, 1]`` and
  ``[2, 2, 2, 2]``) where every BatchNorm is replaced by GroupNorm with 2 groups. BatchNorm keeps
  running statistics (buffers that change in training and leak per-example information across a
  batch), so it is incompatible both with per-example gradient clipping in DP-SGD and with an
  engine that treats the trainable parameters as the whole model state; GroupNorm is the usual
  substitute in DP and DP-FL work (e.g. DP-FedSAM trains a GN-ResNet-18). Two groups follows the
  common ``GroupNorm(2, C)`` choice of those code bases. For small inputs (``H, W <= 64``) the stem
  is the usual CIFAR adaptation: a 3x3 stride-1 ``conv1`` and no max-pool. ``conv1`` takes
  ``C_in`` input channels, so grey-scale inputs work too. Weights are never downloaded.
* ``char_lstm`` — the LEAF Shakespeare next-character model: an 8-dimensional embedding of a
  ``num_classes``-symbol vocabulary, a 2-layer LSTM with 256 hidden units and a linear head on
  the output of the *last* time step. Its input is int64 token ids of shape ``(batch, seq_len)``.

No model has buffers: the engine treats ``model.parameters()`` as the complete model state.

``init="zeros"`` (config ``model.init``, logistic regression only) sets every parameter to
zero after building, as the DP-Fed-LS paper's convex experiments start from w = 0; the
seed is still drawn from ``generator`` so the RNG streams advance the same either way.

Initialisation is deterministic given ``generator``: an integer seed is drawn from it and the
model is built under :func:`torch.random.fork_rng` with the CPU generator seeded from it, so two
builds from equally seeded generators are identical and the global RNG state is left untouched.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import nn

__all__ = ["INIT_MODES", "MODEL_NAMES", "CharLSTM", "build_model", "num_parameters"]

MODEL_NAMES: tuple[str, ...] = (
    "logreg",
    "mlp",
    "cnn",
    "resnet10_gn",
    "resnet18_gn",
    "char_lstm",
)

#: ``model.init`` values: PyTorch's default layer initialisation, or all zeros.
INIT_MODES: tuple[str, ...] = ("default", "zeros")
#: Models for which a zero start is sensible (convex: no symmetry to break).
ZERO_INIT_MODELS: tuple[str, ...] = ("logreg",)

#: Number of GroupNorm groups in the GN-ResNets.
RESNET_GN_GROUPS = 2
#: Inputs with both spatial sides at most this large get the CIFAR-style ResNet stem.
SMALL_INPUT_MAX_SIDE = 64


class CharLSTM(nn.Module):
    """LEAF Shakespeare model: embedding -> 2-layer LSTM -> linear head on the last step.

    Args:
        vocab_size: Number of symbols; also the number of output classes.
        embed_dim: Embedding width (8 in LEAF).
        hidden_size: LSTM hidden units (256 in LEAF).
        num_layers: Stacked LSTM layers (2 in LEAF).
    """

    def __init__(
        self, vocab_size: int, embed_dim: int = 8, hidden_size: int = 256, num_layers: int = 2
    ) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, embed_dim)
        self.lstm = nn.LSTM(embed_dim, hidden_size, num_layers=num_layers, batch_first=True)
        self.fc = nn.Linear(hidden_size, vocab_size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Map int64 ``(batch, seq_len)`` token ids to ``(batch, vocab)`` next-symbol logits."""
        out, _ = self.lstm(self.embedding(tokens))
        return self.fc(out[:, -1, :])


def _require_image_shape(name: str, input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3:
        raise ValueError(
            f"model.name={name} needs an image input_shape (C, H, W), got {tuple(input_shape)}"
        )
    c, h, w = (int(s) for s in input_shape)
    return c, h, w


def _logreg(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), num_classes))


def _mlp(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    d = math.prod(input_shape)
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(d, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, num_classes),
    )


def _cnn(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    c, h, w = _require_image_shape("cnn", input_shape)
    if h < 4 or w < 4:
        raise ValueError(f"model.name=cnn needs H, W >= 4, got input_shape={tuple(input_shape)}")
    return nn.Sequential(
        nn.Conv2d(c, 32, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(32, 64, kernel_size=5, padding=2),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(64 * (h // 4) * (w // 4), 512),
        nn.ReLU(),
        nn.Linear(512, num_classes),
    )


def _resnet_gn(layers: list[int], name: str) -> Callable[[tuple[int, ...], int], nn.Module]:
    def build(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
        # Imported here: torchvision.models pulls in torch._dynamo (~1 s), which every
        # client-worker process would otherwise pay at start-up for any model.
        from torchvision.models.resnet import BasicBlock, ResNet

        c, h, w = _require_image_shape(name, input_shape)
        model = ResNet(
            BasicBlock,
            layers,
            num_classes=num_classes,
            norm_layer=partial(nn.GroupNorm, RESNET_GN_GROUPS),
        )
        if h <= SMALL_INPUT_MAX_SIDE and w <= SMALL_INPUT_MAX_SIDE:
            model.conv1 = nn.Conv2d(c, 64, kernel_size=3, stride=1, padding=1, bias=False)
            model.maxpool = nn.Identity()
        elif c != 3:
            model.conv1 = nn.Conv2d(c, 64, kernel_size=7, stride=2, padding=3, bias=False)
        # Same initialisation torchvision gives the conv layers it builds itself.
        nn.init.kaiming_normal_(model.conv1.weight, mode="fan_out", nonlinearity="relu")
        return model

    return build


def _char_lstm(input_shape: tuple[int, ...], num_classes: int) -> nn.Module:
    if len(input_shape) != 1:
        raise ValueError(
            "model.name=char_lstm needs a token-sequence input_shape (seq_len,), "
            f"got {tuple(input_shape)}"
        )
    return CharLSTM(num_classes)


_BUILDERS: dict[str, Callable[[tuple[int, ...], int], nn.Module]] = {
    "logreg": _logreg,
    "mlp": _mlp,
    "cnn": _cnn,
    "resnet10_gn": _resnet_gn([1, 1, 1, 1], "resnet10_gn"),
    "resnet18_gn": _resnet_gn([2, 2, 2, 2], "resnet18_gn"),
    "char_lstm": _char_lstm,
}
if tuple(_BUILDERS) != MODEL_NAMES:  # the names config validates are the ones built here
    raise RuntimeError(f"model builders {tuple(_BUILDERS)} != MODEL_NAMES {MODEL_NAMES}")


def build_model(
    name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    generator: torch.Generator | None = None,
    init: str = "default",
) -> nn.Module:
    """Build a freshly initialised model by name.

    Args:
        name: One of :data:`MODEL_NAMES`.
        input_shape: Shape of one example: ``(C, H, W)`` for images, ``(seq_len,)`` for text.
        num_classes: Number of output classes (the vocabulary size for ``char_lstm``).
        generator: Source of the initialisation seed. Equally seeded generators give identical
            parameters. With ``None`` the seed is drawn from the global RNG (which then advances
            by that one draw); with a generator the global RNG state is left unchanged.
        init: ``"default"`` (PyTorch's layer init) or ``"zeros"`` (every parameter 0;
            only for :data:`ZERO_INIT_MODELS`).

    Returns:
        The model on the CPU, in training mode, with no buffers.

    Raises:
        ValueError: If ``name`` is unknown, ``num_classes < 1`` or ``input_shape`` does not
            fit the model.
    """
    if name not in _BUILDERS:
        raise ValueError(f"model.name={name} is not one of {', '.join(MODEL_NAMES)}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    if init not in INIT_MODES:
        raise ValueError(f"model.init={init!r} is not one of {', '.join(INIT_MODES)}")
    if init == "zeros" and name not in ZERO_INIT_MODELS:
        raise ValueError(f"model.init=zeros is valid only for {ZERO_INIT_MODELS}, not {name}")
    input_shape = tuple(int(s) for s in input_shape)
    if not input_shape or any(s < 1 for s in input_shape):
        raise ValueError(f"input_shape must be non-empty and positive, got {input_shape}")
    device = generator.device if generator is not None else torch.device("cpu")
    seed = int(torch.randint(0, 2**62, (1,), generator=generator, device=device))
    # devices=[]: only the CPU RNG is forked; models are built on the CPU and seeding only
    # torch.default_generator leaves any CUDA generator untouched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        model = _BUILDERS[name](input_shape, num_classes)
    if init == "zeros":
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
    return model


def num_parameters(model: nn.Module) -> int:
    """Number of trainable (``requires_grad``) scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
