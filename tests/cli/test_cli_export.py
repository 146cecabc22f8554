"""export: a checkpoint's model as Hugging Face safetensors, from full files and sharded directories (ours and
upstream Lightning's), written as ``save_pretrained`` writes it (shards and index past a size, tied weights once); and
the SafetensorsExport callback, which writes the same at the end of ``fit`` under every strategy.

``tests/zoo`` checks that every zoo architecture's export loads with ``from_pretrained`` and gives the trained model's
outputs."""

from __future__ import annotations

import json
import sys
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
from pytorch_lightning.strategies import DDPStrategy
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

from lightning_strategies import FairScaleFSDPStrategy, FSDP2Strategy
from lightning_strategies.callbacks import SafetensorsExport
from lightning_strategies.checkpoint.safetensors_export import write_safetensors
from lightning_strategies.cli import main
from lightning_strategies.testing import ConformanceModel
from tests.conftest import free_loopback_port
from tests.support.helpers import RankRecorder, canonical_checkpoint, fit, new_model, train_and_save
from tests.support.upstream_runs import FSDPStrategyOnCPU, upstream
from tests.support.upstream_runs import fit as upstream_fit

INDEX = "model.safetensors.index.json"


class TiedHeadModel(ConformanceModel):
    """The conformance model with a second head whose weight is the first head's (as ``lm_head`` is ``wte``)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.second_head = nn.Linear(16, 4)
        self.second_head.weight = self.head.weight


def _tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an export, from its one file or through its index."""
    index = directory / "model.safetensors.index.json"
    files = (
        sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() else ["model.safetensors"]
    )
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(directory / name))
    return tensors


def _assert_holds(directory: Path, state: dict[str, Any], without: tuple[str, ...] = ()) -> None:
    exported = _tensors(directory)
    expected = {key: value for key, value in state.items() if key not in without}
    assert exported.keys() == expected.keys()
    for key, value in expected.items():
        assert exported[key].dtype == value.dtype and torch.equal(exported[key], value), key


def _save(checkpoint: dict[str, Any], path: Path) -> Path:
    torch.save(checkpoint, path)
    return path


def _checkpoint(state: dict[str, Any]) -> dict[str, Any]:
    return {"epoch": 0, "global_step": 4, "pytorch-lightning_version": "2.6.0", "state_dict": state}


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=256, n_positions=16, n_embd=64, n_layer=2, n_head=2)
    model: nn.Module = transformers.GPT2LMHeadModel(config).eval()
    return model


# ---------------------------------------------------------------------------------------------- the command


def test_export_has_help_and_exits_0(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", "--help"]) == 0
    assert "--max-shard-size" in capsys.readouterr().out


def test_export_writes_the_model_state_into_model_safetensors(tmp_path: Path) -> None:
    state = dict(ConformanceModel().state_dict())
    source = _save(_checkpoint(state), tmp_path / "model.ckpt")

    assert main(["export", str(source), str(tmp_path / "out")]) == 0

    assert sorted(path.name for path in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    _assert_holds(tmp_path / "out", state)
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as exported:
        assert exported.metadata() == {"format": "pt"}  # from_pretrained refuses a file without it


def test_export_reads_a_checkpoint_in_torchs_legacy_format(tmp_path: Path) -> None:
    state = dict(ConformanceModel().state_dict())
    source = tmp_path / "legacy.ckpt"
    torch.save(_checkpoint(state), source, _use_new_zipfile_serialization=False)  # not a zip: no memory map

    assert main(["export", str(source), str(tmp_path / "out")]) == 0
    _assert_holds(tmp_path / "out", state)


def test_export_keeps_only_a_submodule_without_its_prefix(tmp_path: Path) -> None:
    state = dict(ConformanceModel().state_dict())
    source = _save(_checkpoint(state), tmp_path / "model.ckpt")

    assert main(["export", str(source), str(tmp_path / "out"), "--submodule", "encoder"]) == 0

    _assert_holds(tmp_path / "out", {"weight": state["encoder.weight"], "bias": state["encoder.bias"]})


def test_export_with_an_unknown_submodule_names_the_top_level_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _save(_checkpoint(dict(ConformanceModel().state_dict())), tmp_path / "model.ckpt")

    assert main(["export", str(source), str(tmp_path / "out"), "--submodule", "model"]) == 1

    error = capsys.readouterr().err
    assert "No key of the model state lies under the submodule 'model'" in error
    assert "'encoder', 'head', 'output_scale'" in error and not (tmp_path / "out" / "model.safetensors").exists()


def test_export_dtype_converts_floating_point_tensors_and_keeps_integer_ones(tmp_path: Path) -> None:
    state = {**ConformanceModel().state_dict(), "steps": torch.arange(3)}
    source = _save(_checkpoint(state), tmp_path / "model.ckpt")

    assert main(["export", str(source), str(tmp_path / "out"), "--dtype", "bf16"]) == 0

    exported = _tensors(tmp_path / "out")
    assert exported["steps"].dtype == torch.int64 and torch.equal(exported["steps"], state["steps"])
    assert exported["head.weight"].dtype == torch.bfloat16
    assert torch.equal(exported["head.weight"], state["head.weight"].to(torch.bfloat16))


def test_export_writes_a_tied_weight_once_under_its_first_key(tmp_path: Path) -> None:
    state = dict(TiedHeadModel().state_dict())
    source = _save(_checkpoint(state), tmp_path / "model.ckpt")

    assert main(["export", str(source), str(tmp_path / "out")]) == 0

    _assert_holds(tmp_path / "out", state, without=("second_head.weight",))


def test_export_writes_the_files_save_pretrained_writes_for_gpt2(tmp_path: Path) -> None:
    gpt2 = _gpt2()
    gpt2.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # type: ignore[operator]
    source = _save(_checkpoint({f"model.{key}": value for key, value in gpt2.state_dict().items()}), tmp_path / "c")

    argv = ["export", str(source), str(tmp_path / "ours"), "--submodule", "model", "--max-shard-size", "100KB"]
    assert main(argv) == 0

    ours = sorted(path.name for path in (tmp_path / "ours").iterdir())
    theirs = sorted(path.name for path in (tmp_path / "hf").iterdir() if "safetensors" in path.name)
    assert ours == theirs and len(ours) > 2  # shards and index, named alike
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert index == json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"] and "transformer.wte.weight" in index["weight_map"]


def test_a_gpt2_export_loads_with_from_pretrained_tied_and_with_the_same_outputs(tmp_path: Path) -> None:
    gpt2 = _gpt2()
    source = _save(_checkpoint({f"model.{key}": value for key, value in gpt2.state_dict().items()}), tmp_path / "c")
    assert main(["export", str(source), str(tmp_path / "out"), "--submodule", "model"]) == 0
    gpt2.config.save_pretrained(tmp_path / "out")  # type: ignore[operator]

    loaded = type(gpt2).from_pretrained(tmp_path / "out").eval()  # type: ignore[attr-defined]

    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, gpt2(tokens).logits)


def test_export_replaces_an_earlier_export_only_with_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = dict(ConformanceModel().state_dict())
    source = _save(_checkpoint(state), tmp_path / "model.ckpt")
    out = tmp_path / "out"
    assert main(["export", str(source), str(out), "--max-shard-size", "300"]) == 0  # sharded
    (out / "config.json").write_text("{}")
    before = {path.name: path.read_bytes() for path in out.iterdir()}

    assert main(["export", str(source), str(out)]) == 2
    assert "already holds an export" in capsys.readouterr().err
    assert {path.name: path.read_bytes() for path in out.iterdir()} == before

    assert main(["export", str(source), str(out), "--force"]) == 0  # one file: the old shards and index are gone
    assert sorted(path.name for path in out.iterdir()) == ["config.json", "model.safetensors"]
    _assert_holds(out, state)


def test_export_refuses_keys_behind_a_wrapper_prefix_naming_convert(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    legacy = {f"_forward_module.{key}": value for key, value in ConformanceModel().state_dict().items()}
    source = _save(_checkpoint(legacy), tmp_path / "legacy.ckpt")

    assert main(["export", str(source), str(tmp_path / "out")]) == 1

    error = capsys.readouterr().err
    assert "wrapper-prefix" in error and "lightning-strategies convert" in error
    assert not (tmp_path / "out").exists()


def test_export_refuses_a_stride_0_view_of_2_40_elements_naming_its_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = {**ConformanceModel().state_dict(), "output_scale": torch.zeros(1).expand(2**40)}
    source = _save(_checkpoint(state), tmp_path / "oversized.ckpt")

    assert main(["export", str(source), str(tmp_path / "out")]) == 1

    assert "'output_scale' declares 1,099,511,627,776 elements" in capsys.readouterr().err


def test_export_without_safetensors_names_the_extra_that_installs_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _save(_checkpoint(dict(ConformanceModel().state_dict())), tmp_path / "model.ckpt")
    monkeypatch.setitem(sys.modules, "safetensors.torch", None)  # what `import safetensors.torch` sees uninstalled

    assert main(["export", str(source), str(tmp_path / "out")]) == 2

    assert "pip install 'lightning-strategies[export]'" in capsys.readouterr().err
    with pytest.raises(Exception, match=r"lightning-strategies\[export\]"):  # raised in the workers
        fit("ddp_sharded_fork", new_model(), callbacks=[SafetensorsExport(tmp_path / "callback")], max_epochs=1)


def test_the_writer_holds_one_converted_shard_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    save_file = safetensors.torch.save_file
    shards: list[list[weakref.ref[torch.Tensor]]] = []
    earlier_alive: list[int] = []

    def recording(tensors: dict[str, torch.Tensor], filename: str, metadata: dict[str, str]) -> None:
        earlier_alive.append(sum(ref() is not None for shard in shards for ref in shard))
        shards.append([weakref.ref(tensor) for tensor in tensors.values()])
        save_file(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", recording)
    state = {f"layer{index}.weight": torch.randn(32, 32) for index in range(6)}

    written = write_safetensors(state, tmp_path / "out", dtype="bf16", max_shard_size=2 * 32 * 32 * 2)

    assert len(written.files) == 4 and len(shards) == 3  # 3 shards of 2 bf16 tensors, and the index
    assert earlier_alive == [0, 0, 0]  # each shard's converted tensors are gone before the next is converted
    _assert_holds(tmp_path / "out", {key: value.to(torch.bfloat16) for key, value in state.items()})


# ---------------------------------------------------------------------------------------------- every input kind


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """One epoch of each: our full file and sharded directories, upstream ModelParallelStrategy's and FSDPStrategy's
    sharded directories."""
    root = tmp_path_factory.mktemp("saved")
    paths: dict[str, Path] = {}
    with pytest.MonkeyPatch.context() as environment:
        environment.setenv("MASTER_ADDR", "127.0.0.1")
        environment.setenv("GLOO_SOCKET_IFNAME", "lo")
        ours = {
            "fsdp_fairscale full file": FairScaleFSDPStrategy(start_method="fork"),
            "fsdp_fairscale rank files": FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
            "fsdp2 directory": FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
        }
        for name, strategy in ours.items():
            environment.setenv("MASTER_PORT", str(free_loopback_port()))
            paths[name] = train_and_save(strategy, root / name.replace(" ", "-"), max_epochs=1)
        theirs = {
            "ModelParallelStrategy directory": upstream(True),
            "FSDPStrategy directory": lambda: FSDPStrategyOnCPU(state_dict_type="sharded"),
        }
        for name, factory in theirs.items():
            environment.setenv("MASTER_PORT", str(free_loopback_port()))
            upstream_fit(factory, root / name.replace(" ", "-"), epochs=1)
            paths[name] = root / name.replace(" ", "-") / "epoch=0.ckpt"
    yield paths


SOURCES = [
    "fsdp_fairscale full file",
    "fsdp_fairscale rank files",
    "fsdp2 directory",
    "ModelParallelStrategy directory",
    "FSDPStrategy directory",
]


@pytest.mark.parametrize("source", SOURCES)
def test_export_of_each_checkpoint_kind_holds_its_canonical_model_state(
    source: str, saved: dict[str, Path], tmp_path: Path
) -> None:
    assert main(["export", str(saved[source]), str(tmp_path / "out"), "--no-progress"]) == 0

    _assert_holds(tmp_path / "out", canonical_checkpoint(saved[source])["state_dict"])


def test_export_refuses_to_write_into_the_sharded_directory_it_reads(
    saved: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    directory = saved["fsdp2 directory"]

    assert main(["export", str(directory), str(directory / "export")]) == 2
    assert "lies inside the input" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- the callback


STRATEGIES = {
    "ddp_sharded": lambda: "ddp_sharded_fork",
    "fsdp_fairscale": lambda: "fsdp_fairscale_fork",
    "fsdp_fairscale sharded saves": lambda: FairScaleFSDPStrategy(start_method="fork", state_dict_type="sharded"),
    "fsdp2": lambda: "fsdp2_fork",
    "fsdp2 sharded saves": lambda: FSDP2Strategy(start_method="fork", state_dict_type="sharded"),
    "upstream ddp": lambda: DDPStrategy(start_method="fork", find_unused_parameters=True),
}


@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_the_callback_writes_the_trained_model_at_the_end_of_fit_with_a_tied_weight_once(
    strategy: str, tmp_path: Path
) -> None:
    model = new_model(cls=TiedHeadModel)

    fit(STRATEGIES[strategy](), model, callbacks=[SafetensorsExport(tmp_path / "export")], max_epochs=1)

    trained = dict(model.state_dict())  # the trained weights (the main process's module, after a fork launcher)
    assert not torch.equal(trained["head.weight"], new_model(cls=TiedHeadModel).head.weight.detach())
    _assert_holds(tmp_path / "export", trained, without=("second_head.weight",))


def test_the_callback_exports_a_submodule_in_a_dtype_and_in_shards(tmp_path: Path) -> None:
    model = new_model()
    export = SafetensorsExport(tmp_path / "export", submodule="encoder", dtype="bf16", max_shard_size=256)

    fit("fsdp2_fork", model, callbacks=[export], max_epochs=1)

    files = sorted(path.name for path in (tmp_path / "export").iterdir())
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", INDEX]
    expected = {"weight": model.encoder.weight.detach(), "bias": model.encoder.bias.detach()}
    _assert_holds(tmp_path / "export", {key: value.to(torch.bfloat16) for key, value in expected.items()})


def test_the_callback_refuses_an_unknown_submodule_before_training(tmp_path: Path) -> None:
    steps = RankRecorder(tmp_path, "on_train_batch_start", lambda trainer, module: trainer.global_step)
    export = SafetensorsExport(tmp_path / "export", submodule="model")

    with pytest.raises(Exception, match=r"ConformanceModel has no submodule 'model'; its submodules are \['encoder'"):
        fit("fsdp_fairscale_fork", new_model(), callbacks=[export, steps])

    assert not list(tmp_path.glob("on_train_batch_start-rank*.json")) and not (tmp_path / "export").exists()


class CountingModel(ConformanceModel):
    """The conformance model with state that is not a tensor (a module's extra state), which safetensors cannot hold."""

    def get_extra_state(self) -> dict[str, int]:
        return {"seen": 1}

    def set_extra_state(self, state: dict[str, int]) -> None:
        pass


def test_a_failed_export_raises_on_every_rank_naming_the_key(tmp_path: Path) -> None:
    with pytest.raises(Exception, match=r"SafetensorsExport: writing .* on global rank 0 failed: ExportError") as error:
        fit("fsdp2_fork", new_model(cls=CountingModel), callbacks=[SafetensorsExport(tmp_path / "x")], max_epochs=1)

    assert "_extra_state (dict)" in str(error.value)
    assert not (tmp_path / "x" / "model.safetensors").exists()
