"""Training recipes drawn along every dimension users vary, and the LightningModule each one builds.

A :class:`Recipe` is a frozen, hashable description whose ``repr`` is Python that rebuilds it (``eval`` with this
module's names), so a failing recipe printed by the fuzzer replays alone:
``python3 dev.py fuzz --replay "Recipe(...)"``. :func:`recipes` is the ``hypothesis`` strategy that draws them, each
dimension independently; :class:`RecipeModule` is the module a recipe trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import torch
from hypothesis import strategies as st
from torch import Tensor, nn
from torch.utils.data import DataLoader

from lightning_strategies.testing.models import FEATURES, HIDDEN, OUTPUTS, make_dataset
from tests.support.flavour import pl

Container = Literal["sequential", "moduledict", "modulelist", "nested"]
Call = Literal["forward", "model_attr", "submodules"]
OptimizerName = Literal["sgd", "adam", "adamw_no_decay", "rmsprop", "adagrad"]
Precision = Literal["32-true", "bf16-mixed"]
OURS = ("ddp_sharded", "fsdp_fairscale", "fsdp2")
REFERENCE = "ddp"
#: The strategies that write sharded checkpoints (``state_dict_type="sharded"``) besides full files.
SHARDED_FORMATS = ("fsdp_fairscale", "fsdp2")

#: Samples in the training set; with two ranks and batches of 8, two steps per epoch and rank. Not 4: BatchNorm over
#: the half batches of the recipes that split a batch (2 samples) has a gradient that is rounding noise, which Adam
#: amplified into 3e-5 differences between any two implementations.
SAMPLES = 32
BATCH_SIZE = 8
EPOCHS = 2


@dataclass(frozen=True)
class ModelSpec:
    """The module's shape: containers, ties, frozen and unused parts, buffers, extra state.

    Attributes:
        container: How the two hidden layers are held: ``Sequential``, ``ModuleDict``, ``ModuleList``, or a
            ``ModuleDict`` of a ``ModuleList`` of ``Sequential`` s.
        tied: A ``mirror`` layer whose weight is the first hidden layer's (one parameter, two users).
        frozen: The input layer does not train (``requires_grad_(False)``).
        batchnorm: A ``BatchNorm1d`` after the input layer (running statistics: buffers that change in training).
        nonpersistent_buffer: A constant gain buffer registered with ``persistent=False`` (never in checkpoints).
        extra_state: A submodule with ``get_extra_state`` (counts the forward passes it saw).
        called_twice: A layer applied twice in one forward.
        uncalled: A layer that is never called (its parameters get no gradient).
    """

    container: Container = "sequential"
    tied: bool = False
    frozen: bool = False
    batchnorm: bool = False
    nonpersistent_buffer: bool = False
    extra_state: bool = False
    called_twice: bool = False
    uncalled: bool = False


@dataclass(frozen=True)
class Automatic:
    """Lightning's automatic optimization.

    Attributes:
        accumulate: ``accumulate_grad_batches``.
        clip: ``gradient_clip_algorithm`` (``None``: no clipping).
    """

    accumulate: Literal[1, 2] = 1
    clip: Literal["norm", "value"] | None = None


@dataclass(frozen=True)
class Manual:
    """Manual optimization (``self.automatic_optimization = False``).

    Attributes:
        kind: ``"one"`` optimizer; ``"split"``: two optimizers over the network's two halves (input side, output
            side), each stepped after a backward pass of its own; ``"gan"``: Lightning's GAN (the network is the
            generator, a ``critic`` the discriminator).
        toggle: ``toggle_optimizer``/``untoggle_optimizer`` around each optimizer's pass.
        first: Which part steps first: ``"a"`` the input side or the generator, ``"b"`` the output side or the critic.
        reuse_output: GAN: the generator's output is computed once, before both passes, and reused (detached for the
            critic); otherwise each pass computes it again.
        backward_twice: One optimizer: two ``manual_backward`` calls (the batch's halves) add up before the step.
        clip: ``self.clip_gradients(opt, 0.5, "norm")`` before each step.
    """

    kind: Literal["one", "split", "gan"] = "one"
    toggle: bool = False
    first: Literal["a", "b"] = "a"
    reuse_output: bool = False
    backward_twice: bool = False
    clip: bool = False


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint after the first epoch, written under one strategy and resumed under another.

    Attributes:
        saved_by: The strategy that trains the first epoch and saves (``"ddp"`` or one of ours).
        state_dict_type: ``"full"`` or ``"sharded"`` (sharded only for ``fsdp_fairscale`` and ``fsdp2``).
        resumed_by: The strategy that resumes it and trains the second epoch.
    """

    saved_by: str
    state_dict_type: Literal["full", "sharded"]
    resumed_by: str


Options = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class Recipe:
    """Everything a user chooses: the module, how the step calls it, optimization, optimizer, precision, options.

    Attributes:
        model: The module's shape.
        call: How ``training_step`` calls the network: ``self(x)`` through ``forward``, ``self.model(x)`` (the
            LightningModule's ``forward`` is never called), or each submodule directly from the step.
        optimization: :class:`Automatic` or :class:`Manual`.
        optimizer: SGD with momentum and weight decay, Adam, AdamW with a no-decay group (biases, norms), RMSprop,
            Adagrad.
        scheduler: A ``StepLR`` stepped every step.
        precision: ``"32-true"`` or ``"bf16-mixed"`` (on the CPU Lightning runs ``"16-mixed"`` as bf16).
        options: Per strategy, the keyword arguments drawn for it (``broadcast_buffers`` also goes to ``ddp``).
        checkpoint: A checkpoint in the middle, or ``None``.
    """

    model: ModelSpec = field(default_factory=ModelSpec)
    call: Call = "forward"
    optimization: Automatic | Manual = field(default_factory=Automatic)
    optimizer: OptimizerName = "adam"
    scheduler: bool = False
    precision: Precision = "32-true"
    options: tuple[tuple[str, Options], ...] = ()
    checkpoint: Checkpoint | None = None

    def options_for(self, strategy: str) -> dict[str, Any]:
        """The keyword arguments drawn for ``strategy`` (empty when none were)."""
        return dict(dict(self.options).get(strategy, ()))

    def replay(self) -> str:
        """The command that runs this recipe alone."""
        return f"python3 dev.py fuzz --replay {repr(self)!r}"


# ---------------------------------------------------------------------------------------------- drawing


def _options() -> st.SearchStrategy[tuple[tuple[str, Options], ...]]:
    def items(**choices: st.SearchStrategy[Any]) -> st.SearchStrategy[Options]:
        return st.fixed_dictionaries({}, optional=choices).map(lambda drawn: tuple(sorted(drawn.items())))

    ddp_sharded = items(reduce_buffer_size=st.sampled_from([0, 2**20]), broadcast_buffers=st.booleans())
    fsdp_fairscale = items(
        flatten_parameters=st.booleans(),
        auto_wrap_min_params=st.sampled_from([None, 100, 300]),
        reshard_after_forward=st.booleans(),
        move_grads_to_cpu=st.booleans(),
        broadcast_buffers=st.booleans(),
    )
    fsdp2 = items(
        shard_module_classes=st.sampled_from([(), ("Linear",)]),
        min_num_params=st.sampled_from([None, 100, 300]),
        reshard_after_forward=st.sampled_from([None, True, False]),
        cpu_offload=st.booleans(),
        broadcast_buffers=st.booleans(),
    )
    return st.tuples(ddp_sharded, fsdp_fairscale, fsdp2).map(lambda drawn: tuple(zip(OURS, drawn, strict=True)))


@st.composite
def _checkpoints(draw: st.DrawFn) -> Checkpoint | None:
    if not draw(st.booleans()):
        return None
    saved_by = draw(st.sampled_from((REFERENCE, *OURS)))
    state_dict_type = draw(st.sampled_from(["full", "sharded"])) if saved_by in SHARDED_FORMATS else "full"
    # Upstream ddp reads full files only; ours read every format.
    readers = OURS if state_dict_type == "sharded" else (REFERENCE, *OURS)
    return Checkpoint(saved_by, state_dict_type, draw(st.sampled_from(readers)))


def _normalised(recipe: Recipe) -> Recipe:
    """Fields that a recipe does not use set to their defaults, so that one behaviour has one description."""
    optimization = recipe.optimization
    if isinstance(optimization, Manual):
        optimization = replace(
            optimization,
            toggle=optimization.toggle,
            first=optimization.first if optimization.kind != "one" else "a",
            reuse_output=optimization.reuse_output and optimization.kind == "gan",
            backward_twice=optimization.backward_twice and optimization.kind == "one",
        )
    return replace(recipe, optimization=optimization)


def recipes() -> st.SearchStrategy[Recipe]:
    """Draws a recipe, each dimension independently."""
    models = st.builds(
        ModelSpec,
        container=st.sampled_from(["sequential", "moduledict", "modulelist", "nested"]),
        tied=st.booleans(),
        frozen=st.booleans(),
        batchnorm=st.booleans(),
        nonpersistent_buffer=st.booleans(),
        extra_state=st.booleans(),
        called_twice=st.booleans(),
        uncalled=st.booleans(),
    )
    automatic = st.builds(Automatic, accumulate=st.sampled_from([1, 2]), clip=st.sampled_from([None, "norm", "value"]))
    manual = st.builds(
        Manual,
        kind=st.sampled_from(["one", "split", "gan"]),
        toggle=st.booleans(),
        first=st.sampled_from(["a", "b"]),
        reuse_output=st.booleans(),
        backward_twice=st.booleans(),
        clip=st.booleans(),
    )
    return st.builds(
        Recipe,
        model=models,
        call=st.sampled_from(["forward", "model_attr", "submodules"]),
        optimization=st.one_of(automatic, manual),
        optimizer=st.sampled_from(["sgd", "adam", "adamw_no_decay", "rmsprop", "adagrad"]),
        scheduler=st.booleans(),
        precision=st.sampled_from(["32-true", "bf16-mixed"]),
        options=_options(),
        checkpoint=_checkpoints(),
    ).map(_normalised)


# ---------------------------------------------------------------------------------------------- the module


class ForwardCounter(nn.Module):
    """Extra state: how many forward passes this rank's module ran (saved through ``get_extra_state``)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def forward(self, inputs: Tensor) -> Tensor:
        self.seen += 1
        return inputs

    def get_extra_state(self) -> Any:
        return {"seen": self.seen}

    def set_extra_state(self, state: Any) -> None:
        self.seen = int(state["seen"])


def _hidden_layers(container: Container) -> nn.Module:
    first, second = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)
    if container == "sequential":
        return nn.Sequential(first, nn.Tanh(), second)
    if container == "moduledict":
        return nn.ModuleDict({"first": first, "second": second})
    if container == "modulelist":
        return nn.ModuleList([first, second])
    return nn.ModuleDict({"blocks": nn.ModuleList([nn.Sequential(first, nn.Tanh()), nn.Sequential(second)])})


def _hidden_linears(hidden: nn.Module) -> list[nn.Linear]:
    return [module for module in hidden.modules() if isinstance(module, nn.Linear)]


class Network(nn.Module):
    """The network a recipe trains: input layer, two hidden layers in the drawn container, optional parts, head.

    ``compose`` calls every submodule itself; ``forward`` is ``compose``. A step that calls "submodules directly"
    calls ``compose`` from ``training_step``, outside any ``forward`` of this module or the LightningModule.
    """

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.spec = spec
        # No bias before a BatchNorm (as models write it): the norm cancels it, its gradient is rounding noise that
        # Adam scales up, and runs that differ only in the order of a sum would end far apart on it.
        self.stem = nn.Linear(FEATURES, HIDDEN, bias=not spec.batchnorm)
        if spec.frozen:
            self.stem.requires_grad_(False)
        self.norm = nn.BatchNorm1d(HIDDEN) if spec.batchnorm else None
        if spec.nonpersistent_buffer:
            self.register_buffer("gain", torch.linspace(0.5, 1.5, HIDDEN), persistent=False)
        self.hidden = _hidden_layers(spec.container)
        self.repeated = nn.Linear(HIDDEN, HIDDEN) if spec.called_twice else None
        if spec.tied:
            self.mirror = nn.Linear(HIDDEN, HIDDEN)
            self.mirror.weight = _hidden_linears(self.hidden)[0].weight
        self.unused = nn.Linear(HIDDEN, HIDDEN) if spec.uncalled else None
        self.counter = ForwardCounter() if spec.extra_state else None
        self.head = nn.Linear(HIDDEN, OUTPUTS)

    def input_side(self) -> list[nn.Parameter]:
        """The first half's parameters (input layer, norm, hidden layers) for the ``split`` recipes."""
        modules = [self.stem, self.norm, self.hidden]
        return [param for module in modules if module is not None for param in module.parameters()]

    def compose(self, inputs: Tensor) -> Tensor:
        features = self.stem(inputs)
        if self.norm is not None:
            features = self.norm(features)
        features = torch.tanh(features)
        if self.spec.nonpersistent_buffer:
            features = features * self.gain
        for layer in self._hidden_sequence():
            features = layer(features)
        features = torch.tanh(features)
        if self.repeated is not None:
            features = torch.tanh(self.repeated(torch.tanh(self.repeated(features))))
        if self.spec.tied:
            features = torch.tanh(self.mirror(features))
        if self.counter is not None:
            features = self.counter(features)
        output: Tensor = self.head(features)
        return output

    def _hidden_sequence(self) -> list[nn.Module]:
        # By the drawn container, not by isinstance: fsdp_fairscale's auto-wrapping puts a wrapper where a large
        # Sequential was (users index containers by what they built, not by what they find).
        hidden, container = self.hidden, self.spec.container
        if container == "sequential":
            return [hidden]
        if container == "modulelist":
            return [hidden[0], nn.Tanh(), hidden[1]]  # type: ignore[index]
        if container == "nested":
            return list(hidden["blocks"])  # type: ignore[index]
        return [hidden["first"], nn.Tanh(), hidden["second"]]  # type: ignore[index]

    def forward(self, inputs: Tensor) -> Tensor:
        return self.compose(inputs)


class RecipeModule(pl.LightningModule):
    """The LightningModule of a recipe (seed the global RNG before building it: every strategy gets the same init)."""

    def __init__(self, recipe: Recipe) -> None:
        super().__init__()
        self.recipe = recipe
        self.model = Network(recipe.model)
        manual = recipe.optimization if isinstance(recipe.optimization, Manual) else None
        self.manual = manual
        self.automatic_optimization = manual is None
        self.critic = (
            nn.Sequential(nn.Linear(OUTPUTS, HIDDEN), nn.LeakyReLU(0.2), nn.Linear(HIDDEN, 1))
            if manual is not None and manual.kind == "gan"
            else None
        )

    def forward(self, inputs: Tensor) -> Tensor:
        return self.model(inputs)

    def network(self, inputs: Tensor) -> Tensor:
        """The network's output, called the way the recipe says."""
        if self.recipe.call == "forward":
            output: Tensor = self(inputs)
            return output
        if self.recipe.call == "model_attr":
            output = self.model(inputs)
            return output
        return self.model.compose(inputs)

    # ------------------------------------------------------------------ steps

    def training_step(self, batch: list[Tensor], batch_idx: int) -> Tensor | None:
        inputs, targets = batch
        if self.manual is None:
            return nn.functional.mse_loss(self.network(inputs), targets)
        if self.manual.kind == "one":
            self._one_optimizer_step(inputs, targets)
        elif self.manual.kind == "split":
            self._split_step(inputs, targets)
        else:
            self._gan_step(noise=inputs, real=targets)
        for scheduler in self._schedulers():
            scheduler.step()
        return None

    def _schedulers(self) -> list[Any]:
        schedulers = self.lr_schedulers()
        if schedulers is None:
            return []
        return schedulers if isinstance(schedulers, list) else [schedulers]

    def _optimizers(self) -> list[Any]:
        optimizers = self.optimizers()
        return optimizers if isinstance(optimizers, list) else [optimizers]

    def _update(self, optimizer: Any, loss_passes: list[Any]) -> None:
        """zero_grad, backward passes (each a callable giving a loss), clipping and step, toggled if drawn."""
        manual = self.manual
        if manual is None:
            raise RuntimeError("manual updates need manual optimization")
        if manual.toggle:
            self.toggle_optimizer(optimizer)
        # Zeroed before the backward passes: a pass also leaves gradients on the other optimizer's parameters, which
        # must not carry into the next step (a checkpoint holds no gradients, so a resumed run could not match).
        optimizer.zero_grad()
        for loss_pass in loss_passes:
            self.manual_backward(loss_pass())
        if manual.clip:
            self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        if manual.toggle:
            self.untoggle_optimizer(optimizer)

    def _one_optimizer_step(self, inputs: Tensor, targets: Tensor) -> None:
        (optimizer,) = self._optimizers()
        manual = self.manual
        if manual is not None and manual.backward_twice:
            half = len(inputs) // 2
            passes = [
                lambda: nn.functional.mse_loss(self.network(inputs[:half]), targets[:half]) / 2,
                lambda: nn.functional.mse_loss(self.network(inputs[half:]), targets[half:]) / 2,
            ]
        else:
            passes = [lambda: nn.functional.mse_loss(self.network(inputs), targets)]
        self._update(optimizer, passes)

    def _split_step(self, inputs: Tensor, targets: Tensor) -> None:
        optimizers = self._optimizers()
        order = optimizers if self.manual is None or self.manual.first == "a" else optimizers[::-1]
        for optimizer in order:
            self._update(optimizer, [lambda: nn.functional.mse_loss(self.network(inputs), targets)])

    def _gan_step(self, noise: Tensor, real: Tensor) -> None:
        generator_optimizer, critic_optimizer = self._optimizers()
        critic = self.critic
        manual = self.manual
        if critic is None or manual is None:
            raise RuntimeError("a GAN step needs its critic")
        ones, zeros = torch.ones(len(real), 1), torch.zeros(len(real), 1)
        bce = nn.functional.binary_cross_entropy_with_logits
        fake_once = self.network(noise) if manual.reuse_output else None

        def fake() -> Tensor:
            return fake_once if fake_once is not None else self.network(noise)

        def generator_loss() -> Tensor:
            return bce(critic(fake()), ones)

        def critic_loss() -> Tensor:
            return (bce(critic(real), ones) + bce(critic(fake().detach()), zeros)) / 2

        updates = [(generator_optimizer, generator_loss), (critic_optimizer, critic_loss)]
        for optimizer, loss in updates if manual.first == "a" else updates[::-1]:
            self._update(optimizer, [loss])

    # ------------------------------------------------------------------ optimizers and data

    def _make_optimizer(self, named: list[tuple[str, nn.Parameter]]) -> torch.optim.Optimizer:
        params = [param for _, param in named]
        name = self.recipe.optimizer
        if name == "sgd":
            return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-2)
        if name == "adam":
            return torch.optim.Adam(params, lr=1e-2)
        if name == "adamw_no_decay":
            no_decay = [param for key, param in named if key.endswith("bias") or ".norm." in f".{key}"]
            decay = [param for key, param in named if not (key.endswith("bias") or ".norm." in f".{key}")]
            groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}]
            return torch.optim.AdamW([group for group in groups if group["params"]], lr=1e-2)
        if name == "rmsprop":
            return torch.optim.RMSprop(params, lr=1e-2, momentum=0.5)
        return torch.optim.Adagrad(params, lr=5e-2)

    def _parameter_sets(self) -> list[list[tuple[str, nn.Parameter]]]:
        named = list(self.named_parameters())
        manual = self.manual
        if manual is None or manual.kind == "one":
            return [named]
        if manual.kind == "gan":
            return [
                [(key, param) for key, param in named if not key.startswith("critic.")],
                [(key, param) for key, param in named if key.startswith("critic.")],
            ]
        input_side = {id(param) for param in self.model.input_side()}
        return [
            [(key, param) for key, param in named if id(param) in input_side],
            [(key, param) for key, param in named if id(param) not in input_side],
        ]

    def configure_optimizers(self) -> Any:
        optimizers = [self._make_optimizer(named) for named in self._parameter_sets()]
        if not self.recipe.scheduler:
            return optimizers
        return [
            {
                "optimizer": optimizer,
                "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, 0.7), "interval": "step"},
            }
            for optimizer in optimizers
        ]

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(make_dataset(SAMPLES), batch_size=BATCH_SIZE)


def build_module(recipe: Recipe, seed: int = 7) -> RecipeModule:
    """The recipe's module with the same initial weights for every strategy."""
    pl.seed_everything(seed, verbose=False)
    return RecipeModule(recipe)
