"""The resume matrix's remote cells (also run under the version legs, ``dev.py``): each strategy and format saves to
the store with ``ModelCheckpoint``, another strategy resumes that checkpoint from the URL and trains on, its final
weights equal the saving run's uninterrupted ones, and the local copy the resume read is gone afterwards. Each saver
is resumed by the next strategy in turn, so that every saver and every resumer is covered in five pairs (the local
matrix runs every pair: ``tests/both_packages/test_resume_matrix.py``)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from tests.s3.test_remote_checkpoints import RecordsTheStart, strategy_for
from tests.support.helpers import SAVE_FORMATS, STRATEGY_CLASSES, fit, new_model
from tests.support.s3_server import S3Server

RESUMERS = sorted(STRATEGY_CLASSES)
# Each saver resumed by another strategy than its own, and every strategy resuming at least once.
PAIRS = [
    (saver, next(r for r in RESUMERS[index % 3 :] + RESUMERS if r != saver[0]))
    for index, saver in enumerate(SAVE_FORMATS)
]
EPOCHS = {"limit_train_batches": 2, "limit_val_batches": 0, "enable_checkpointing": True}


@pytest.mark.parametrize(("saver", "resumer"), PAIRS, ids=[f"{s}-{f}-by-{r}" for (s, f), r in PAIRS])
def test_a_checkpoint_on_the_store_resumes_under_another_strategy_as_if_uninterrupted(
    store: S3Server,
    s3_bucket: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    saver: tuple[str, str],
    resumer: str,
) -> None:
    name, state_dict_type = saver
    run = f"{s3_bucket}/run"
    uninterrupted = new_model()
    callback = ModelCheckpoint(dirpath=run, filename="{epoch}", save_top_k=-1)
    fit(strategy_for(name, state_dict_type), uninterrupted, callbacks=[callback], max_epochs=2, **EPOCHS)

    start = RecordsTheStart(tmp_path / "start.pt")
    resumed = new_model()  # the same data; other weights, which the resume must replace
    with torch.no_grad():
        for parameter in resumed.parameters():
            parameter.add_(1.0)
    scratch = tmp_path / "scratch"  # where the ranks' shared local copy of the checkpoint goes (the forks inherit it)
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    fit(strategy_for(resumer), resumed, ckpt_path=f"{run}/epoch=0.ckpt", callbacks=[start], max_epochs=2, **EPOCHS)  # type: ignore[arg-type]

    assert not list(scratch.glob("lightning-strategies-download-*"))  # the copy is gone once the restore is done

    assert start.step == 2
    for key, value in uninterrupted.state_dict().items():
        assert torch.allclose(resumed.state_dict()[key], value, rtol=0, atol=1e-5), key
