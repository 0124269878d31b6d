"""bench/probes/gpu_timeline.py's summary of a recorded-shape trace: streams, bins from the first big
copy, and the compute gaps."""
import os
import sys

BENCH = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.append(os.path.join(BENCH, "probes"))

import gpu_timeline  # noqa: E402

MB = 1 << 20


def _ev(cat: str, ts_s: float, dur_s: float, stream: int, nbytes: int = 0) -> dict:
    return {"ph": "X", "cat": cat, "name": cat, "ts": ts_s * 1e6, "dur": dur_s * 1e6,
            "args": {"stream": stream, "bytes": nbytes}}


def test_summary_bins_copies_and_finds_compute_gaps():
    events = [_ev("gpu_memcpy", 1.0, 0.02, 13, 512 * MB),   # t=0: the first big copy
              _ev("kernel", 1.01, 0.03, 7),
              _ev("kernel", 1.10, 0.02, 7),                  # 60 ms after the last kernel ended
              _ev("gpu_memcpy", 1.12, 0.01, 13, 256 * MB),
              _ev("gpu_memcpy", 0.5, 0.001, 7, 1 * MB)]      # before t=0: in the streams, not the bins
    lines = gpu_timeline.summarise(events)
    streams = {ln.split()[0]: ln.split() for ln in lines[1:3]}
    assert streams["13"][1:3] == ["0", "2"] and float(streams["13"][4]) == round(768 * MB / 1e9, 2)
    assert streams["7"][1:3] == ["2", "1"]
    bins = lines[lines.index(next(ln for ln in lines if ln.startswith("from the first"))) + 1:]
    assert bins[0].split() == ["0.00", "30.0", "0.54"]       # 30 ms of kernels, 512 MiB copied
    assert bins[2].split() == ["0.10", "20.0", "0.27"]
    gaps = lines[lines.index(next(ln for ln in lines if ln.startswith("kernel gaps"))) + 1:]
    assert [g.split() for g in gaps] == [["0.040", "60.0"]]


def test_no_big_copy_no_timeline():
    lines = gpu_timeline.summarise([_ev("kernel", 0.0, 0.01, 7)])
    assert lines[-1].startswith("no copy of 64 MB")
