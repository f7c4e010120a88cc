"""What checkpoint integrity costs at save time: CRC-32 (zlib) vs blake2b throughput, and a DCP save of a model
with ~256 MB of state (weights + Adam moments) timed with and without its manifest's checksums, plus the resume
scan's verification.

Run from the repository root:  python -m benchmarks.checkpoint_integrity_bench [--mb 256]
Writes benchmarks/results/checkpoint_integrity.json.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import tempfile
import time
import zlib
from pathlib import Path

import torch
from torch import nn

from lightning_llmpar.checkpointing import dcp
from lightning_llmpar.checkpointing.manifest import MANIFEST, read_manifest, verify_manifest, write_manifest

OUT = Path(__file__).parent / "results" / "checkpoint_integrity.json"


def _throughput(fn: object, data: bytes, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn(data)  # type: ignore[operator]
        best = min(best, time.perf_counter() - t0)
    return len(data) / best / 2**30


def _model(mb: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    # Adam keeps two moments per weight: state = 3 x weights.
    width = 1024
    rows = max(1, mb * 2**20 // 3 // 4 // width // 8)
    model = nn.Sequential(*[nn.Linear(width, rows, bias=False) for _ in range(8)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    return model, opt


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=int, default=256, help="checkpoint size to save (weights + Adam state)")
    args = parser.parse_args()
    data = os.urandom(256 * 2**20)
    crc = _throughput(zlib.crc32, data)
    blake = _throughput(lambda b: hashlib.blake2b(b).digest(), data)
    model, opt = _model(args.mb)
    with tempfile.TemporaryDirectory() as tmp:
        saves, manifests, scans = [], [], []
        for i in range(3):
            path = Path(tmp) / f"step={i}.ckpt"
            t0 = time.perf_counter()
            dcp.save_checkpoint(path, model, [opt], {"step": i}, is_rank_zero=True, barrier=lambda: None)
            saves.append(time.perf_counter() - t0)
            (path / MANIFEST).unlink()
            t0 = time.perf_counter()
            write_manifest(path, "dcp")  # the checksum part of the save, timed alone
            manifests.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            assert verify_manifest(path, read_manifest(path) or {}) is None
            scans.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    save, manifest, scan = min(saves), min(manifests), min(scans)
    result = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores (shared)",
        "torch": torch.__version__,
        "checksum_gib_per_s": {"crc32_zlib": round(crc, 3), "blake2b": round(blake, 3)},
        "chosen": "crc32_zlib",
        "checkpoint_mb": round(size / 2**20, 1),
        "save_s_with_manifest": round(save, 3),
        "manifest_s": round(manifest, 3),
        "checksum_share_of_save": round(manifest / save, 3),
        "verify_s": round(scan, 3),
        "note": "best of 3; files are checksummed from the page cache just after the write; the manifest is written"
                " by rank 0 for every rank's files, in 8 threads (zlib releases the GIL)",
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
