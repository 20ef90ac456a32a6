"""Reading slices of an HF safetensors checkpoint without loading whole tensors.

Each rank reads only the rows or columns of its shard (``safe_open(...).get_slice``), so no
rank ever holds a full copy of a sharded weight.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open


class Checkpoint:
    """The tensors of every ``*.safetensors`` file of a folder, by name."""

    def __init__(self, folder: str | Path, dtype: torch.dtype, device: torch.device) -> None:
        self.folder = Path(folder)
        self.dtype = dtype
        self.device = device
        self._files: dict[str, str] = {}
        files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {self.folder}")
        self._handles = {str(f): safe_open(str(f), framework="pt", device="cpu") for f in files}
        for f, h in self._handles.items():
            for k in h.keys():  # noqa: SIM118 (a safetensors handle, not a dict)
                self._files[k] = f

    @property
    def config(self) -> dict[str, object]:
        return json.loads((self.folder / "config.json").read_text())

    def has(self, name: str) -> bool:
        return name in self._files

    def names(self) -> list[str]:
        return list(self._files)

    def _slice(self, name: str):  # type: ignore[no-untyped-def]
        if name not in self._files:
            raise KeyError(f"tensor {name!r} missing from the checkpoint in {self.folder}")
        return self._handles[self._files[name]].get_slice(name)

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype=self.dtype, device=self.device).contiguous()

    def full(self, name: str) -> torch.Tensor:
        return self._out(self._slice(name)[:])

    def rows(self, name: str, a: int, b: int) -> torch.Tensor:
        """``tensor[a:b]`` (dim 0)."""
        return self._out(self._slice(name)[a:b])

    def cols(self, name: str, a: int, b: int) -> torch.Tensor:
        """``tensor[:, a:b]`` (dim 1)."""
        return self._out(self._slice(name)[:, a:b])

    def rows_padded(self, name: str, a: int, b: int) -> torch.Tensor:
        """``tensor[a:b]`` with zero rows where ``b`` passes the end (a padded vocabulary)."""
        sl = self._slice(name)
        n = sl.get_shape()[0]
        part = sl[a : min(b, n)] if a < n else None
        width = sl.get_shape()[1]
        out = torch.zeros(b - a, width, dtype=self.dtype, device=self.device)
        if part is not None and part.shape[0]:
            out[: part.shape[0]] = part.to(self.dtype)
        return out
