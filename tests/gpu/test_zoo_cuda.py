"""Real architectures of the model zoo (``tests/zoo``) on one GPU: saved by each strategy, resumed under ``ddp``.

Skipped cleanly where the zoo is not in the checkout or ``transformers`` is not installed. Each model is built from its
``transformers`` config object (nothing is downloaded), as the zoo builds it on CPU.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

from tests.gpu.conftest import ONE_DEVICE, needs_cuda
from tests.support.helpers import LossRecorder, assert_same_weights, fit

pytest.importorskip("transformers")
zoo = pytest.importorskip("tests.zoo.models", reason="the model zoo (tests/zoo) is not in this checkout")

pytestmark = needs_cuda

MODELS = {"gpt2": "GPT2Module", "resnet": "ResNetModule"}
SEED = 1234
#: Largest loss and weight difference to the uninterrupted run: CUDA kernels may sum in another order from run to run.
ATOL = 1e-5


def _model(name: str) -> pl.LightningModule:
    pl.seed_everything(SEED, verbose=False)
    module: pl.LightningModule = getattr(zoo, MODELS[name])()
    return module


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("strategy", ["ddp_sharded", "fsdp_fairscale", "fsdp2"])
def test_a_zoo_model_saved_on_one_gpu_resumes_under_ddp_as_the_uninterrupted_run(
    tmp_path: Path, model: str, strategy: str
) -> None:
    whole = _model(model)
    fit("ddp", whole, callbacks=[LossRecorder(tmp_path / "whole")], max_epochs=2, **ONE_DEVICE)
    saving = ModelCheckpoint(dirpath=tmp_path / "saved", filename="{epoch}", save_top_k=-1)
    fit(strategy, _model(model), callbacks=[saving], max_epochs=1, enable_checkpointing=True, **ONE_DEVICE)
    resumed = _model(model)
    fit(
        "ddp",
        resumed,
        ckpt_path=tmp_path / "saved" / "epoch=0.ckpt",
        callbacks=[LossRecorder(tmp_path / "resumed")],
        max_epochs=2,
        **ONE_DEVICE,
    )

    losses = json.loads((tmp_path / "whole" / "losses.json").read_text())
    after = json.loads((tmp_path / "resumed" / "losses.json").read_text())
    assert after, "the resumed run trained no step"
    assert max(abs(a - b) for a, b in zip(after, losses[len(losses) - len(after) :], strict=True)) <= ATOL
    assert_same_weights(whole, resumed, atol=ATOL)
