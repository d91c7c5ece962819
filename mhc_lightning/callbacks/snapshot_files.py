"""GradientSnapshots on disk: `snapshot-step<step>.pt` plus a JSON sidecar with its sha256, written atomically (the
sidecar last, so a file without one is ignored), the newest `keep` kept; loading checks the sha256 first."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..files import sha256_file
from .snapshot_state import Snapshot


class SnapshotFiles:
    def __init__(self, dirpath: Path, keep: int):
        self.dirpath, self.keep = Path(dirpath), keep
        self.records: list[dict] = []  # sidecar records of the files in dirpath, oldest first

    def write(self, snap: Snapshot) -> None:
        path = self.dirpath / f"snapshot-step{snap.step:08d}.pt"
        tmp = path.with_suffix(".pt.tmp")
        payload = {
            "step": snap.step,
            "position": snap.position,
            "state": snap.state,
            "probe": snap.probe,
            "probe_grad_norm": snap.probe_grad_norm,
        }
        torch.save(payload, tmp)
        digest = sha256_file(tmp)
        os.replace(tmp, path)
        record = {
            "step": snap.step,
            "file": path.name,
            "sha256": digest,
            "probe_grad_norm": snap.probe_grad_norm,
            "position": snap.position,
        }
        side = path.with_suffix(".json")
        side.with_suffix(".json.tmp").write_text(json.dumps(record, indent=1))
        os.replace(side.with_suffix(".json.tmp"), side)  # the sidecar appears last: a file without one is ignored
        snap.path, snap.sha256 = str(path), digest
        self.records = [d for d in self.records if d["step"] != snap.step] + [record]
        while len(self.records) > self.keep:
            old = self.records.pop(0)
            for p in (self.dirpath / old["file"], (self.dirpath / old["file"]).with_suffix(".json")):
                p.unlink(missing_ok=True)

    def load(self, rec: dict) -> Snapshot:
        """The snapshot of a record; ValueError (the reason) for a missing, altered or unreadable file."""
        path = self.dirpath / rec["file"]
        side = path.with_suffix(".json")
        if not path.exists() or not side.exists():
            raise ValueError(f"missing file {path.name} or its sidecar")
        expected = json.loads(side.read_text())["sha256"]
        actual = sha256_file(path)
        if actual != expected:
            raise ValueError(f"checksum mismatch for {path.name} (sha256 {actual[:12]}… != recorded {expected[:12]}…)")
        try:
            payload = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as err:  # noqa: BLE001 - any unreadable file is simply not a valid snapshot
            raise ValueError(f"unreadable {path.name}: {err}") from err
        return Snapshot(
            step=payload["step"],
            position=payload["position"],
            state=payload["state"],
            probe=payload["probe"],
            probe_grad_norm=payload["probe_grad_norm"],
            path=str(path),
        )
