"""The MLP chunk benchmark: its chunks cover every row, and it runs end to end on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks import mlp_split as bench


def test_by_chunks_puts_every_row_back_in_place():
    x = torch.arange(300 * 4, dtype=torch.float32).view(300, 4)
    for chunk in (64, 100, 299, 300, 1000):
        assert torch.equal(bench.by_chunks(lambda t: t * 2 + 1, x, chunk), x * 2 + 1), chunk


def test_cpu_smoke_run_reports_bits_and_times(tmp_path, monkeypatch, capsys):
    # small linears (in-features a multiple of the int8 path's 256-column rotation groups)
    monkeypatch.setattr(bench, "LINEARS", {"fc1": (256, 192), "fc2": (256, 64)})
    out = tmp_path / "mlp.json"
    bench.main(["--device", "cpu", "--seq", "200", "--chunk", "64", "1000", "--reps", "2", "--warmup", "0",
                "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["device"] == "cpu"
    (row,) = report["results"]
    assert row["seq"] == 200 and set(row["linears"]) == {"fc1", "fc2"}
    for formats in row["linears"].values():
        assert "bf16" in formats
        for entry in formats.values():
            assert set(entry["p50_ms"]) == {"whole", "chunk 64", "chunk 1000"}
            assert all(v > 0 for v in entry["p50_ms"].values())
            assert entry["whole_over"]["whole"] == 1.0
            assert entry["bit_identical"]["1000"] is True  # one chunk is the whole product
    assert "same bits as whole" in capsys.readouterr().out


def test_chunk_sizes_must_be_positive():
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--chunk", "0"])
