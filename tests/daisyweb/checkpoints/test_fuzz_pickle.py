"""Fuzz the ``.pt`` reader at the pickle-opcode level, in a child under a memory limit.

The mutations and checks are in ``pickle_fuzz.py``; this test writes the seed files (our
checkpoint and tree, torch's state_dict and views, protocol 2 and 4) and runs it.
"""

import collections
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from daisyweb.checkpoints.checkpoint import TokenizerInfo, checkpoint_to_bytes, make_checkpoint
from daisyweb.checkpoints.ptfile import save_pt
from daisyweb.model import ModelConfig, param_count
from daisyweb.optim import AdamConfig, DaisyAdam

CASES = 4000
RNG_SEED = 14
CHILD_MEMORY = 640 << 20  # ~150 MB of it is the interpreter, numpy and daisyweb


def _write_seeds(directory: Path) -> None:
    model = ModelConfig(vocab=20, width=8, layers=1, heads=2, seq=4)
    n = param_count(model)
    rng = np.random.default_rng(0)
    params = rng.standard_normal(n).astype(np.float32)
    opt = DaisyAdam(AdamConfig(lr=1e-2), n)
    opt.step(params, rng.standard_normal(n).astype(np.float32))
    ckpt = make_checkpoint(model, TokenizerInfo(20, "ab" * 32), params, opt,
                           {"batch": 4, "data": "builtin"})
    (directory / "ours.ckpt.pt").write_bytes(checkpoint_to_bytes(ckpt))
    buf = io.BytesIO()
    save_pt(buf, {"meta": {"dims": [4, 2**40, -3], "tup": (1, "x"), "none": None},
                  "od": collections.OrderedDict(w=rng.standard_normal((3, 4)).astype(np.float32)),
                  "i64": np.arange(6, dtype=np.int64).reshape(2, 3) * 7919,
                  "u8": rng.integers(0, 255, 9).astype(np.uint8), "empty": np.zeros((0, 3)),
                  "scalar": np.array(2.5), "flags": np.array([True, False])})
    (directory / "ours_tree.pt").write_bytes(buf.getvalue())
    torch.manual_seed(0)
    sd = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3)).state_dict()
    torch.save(sd, directory / "torch_sd.pt")
    base = torch.randn(24)
    views = {"a": base[2:10], "b": base.view(4, 6).t(), "c": base[::3], "s": torch.tensor(1.5),
             "h": torch.randn(5).half(), "l": torch.arange(5) * 104729, "list": [1.0, None],
             "nested": {"x": base.view(2, 12)[1]}}
    torch.save(views, directory / "torch_views.pt")
    torch.save(views, directory / "torch_views_p4.pt", pickle_protocol=4)


def test_mutated_pickles_are_refused_or_valid_in_bounded_memory(tmp_path):
    _write_seeds(tmp_path)
    child = Path(__file__).with_name("pickle_fuzz.py")
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, str(child), str(tmp_path), str(CASES),
                          str(RNG_SEED), str(CHILD_MEMORY)],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["failures"] == [], json.dumps(report["failures"], indent=1)[:4000]
    outcomes = report["outcomes"]
    assert report["cases"] == CASES
    refused = sum(v for k, v in outcomes.items() if k.startswith("refused"))
    loaded = sum(v for k, v in outcomes.items() if k.startswith("loaded"))
    # The mutations reach both ends: many kinds of refusal, and files that still load.
    assert refused > CASES // 4 and loaded > CASES // 20, outcomes
    assert len([k for k in outcomes if k.startswith("refused")]) > 30, outcomes
