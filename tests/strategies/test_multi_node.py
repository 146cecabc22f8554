"""Two nodes on one machine: two torchrun launches on 127.0.0.1 (one process each), then a one-process resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_strategies.checkpoint import check_model_state
from lightning_strategies.testing import ConformanceModel, SaveAfterRestore
from tests.support.helpers import fit, new_model

SCRIPT = Path(__file__).parents[1] / "scripts" / "train.py"


def _torchrun_two_nodes(strategy: str, out: Path, port: int) -> None:
    environment = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])}
    for name in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK"):
        environment.pop(name, None)
    nodes = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                "--nproc-per-node=1",
                f"--node-rank={node}",
                "--master-addr=127.0.0.1",
                f"--master-port={port}",
                str(SCRIPT),
                strategy,
                str(out),
                "2",
            ],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for node in range(2)
    ]
    outputs = []
    try:
        for node in nodes:
            outputs.append(node.communicate(timeout=240)[0])
    finally:
        for node in nodes:
            if node.poll() is None:
                node.kill()
    for node, output in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, output[-3000:]


@pytest.mark.parametrize("strategy", ["fsdp_fairscale", "ddp_sharded"])
def test_two_nodes_train_and_save_and_one_process_resumes(
    tmp_path: Path, loopback_rendezvous: int, strategy: str
) -> None:
    _torchrun_two_nodes(strategy, tmp_path, loopback_rendezvous)

    records = [json.loads((tmp_path / f"environment-rank{rank}.json").read_text()) for rank in range(2)]
    assert [record["environment"] for record in records] == ["TorchElasticEnvironment"] * 2
    assert [(r["global_rank"], r["node_rank"], r["world_size"], r["num_nodes"]) for r in records] == [
        (0, 0, 2, 2),
        (1, 1, 2, 2),
    ]
    saved = tmp_path / "epoch=0.ckpt"
    checkpoint = torch.load(saved, weights_only=True)
    check_model_state(ConformanceModel().state_dict(), checkpoint["state_dict"])
    assert checkpoint["lightning_strategies"]["world_size"] == 2

    restored = tmp_path / "restored.ckpt"
    fit(strategy, new_model(seed=11), ckpt_path=saved, callbacks=[SaveAfterRestore(restored)], devices=1)
    after = torch.load(restored, weights_only=True)
    for key, value in checkpoint["state_dict"].items():
        assert torch.equal(value, after["state_dict"][key]), key
    assert sorted(after["optimizer_states"][0]["state"]) == [0, 1, 2, 3]
