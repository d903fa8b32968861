"""docs/benchmarks.md as flashop.bench renders it: from synthetic per-device JSON (values, ratios, summary,
other devices kept on a re-run), and end to end from a tiny real CPU benchmark."""
import json
import os

import pytest

import flashop
from flashop import bench

BF16_D128_1K_FLOPS = 4.0 * 32 * 16 * 1024 * 1024 * 128  # 32 x 1024 tokens, 16 heads, non-causal forward


def row(mode, seqlen, ms, dtype="bf16", d=128, causal=False):
    batch, heads = 32768 // seqlen, 2048 // d
    return dict(dtype=dtype, headdim=d, seqlen=seqlen, batch=batch, heads=heads, causal=causal, mode=mode, ms=ms)


def gpu_report(flashop_1k_ms=1.0):
    return {
        "format": bench.REPORT_FORMAT, "device": "cuda", "name": "NVIDIA H100 80GB HBM3", "slug": "h100",
        "date": "2000-01-01", "torch": "2.x", "cuda": "12.x", "cudnn": 90000, "tokens": 32768, "rounds": 3,
        "peers": ["flash", "cudnn"], "config": None, "timing": "order balanced over rounds, 0.3 s settle",
        "results": [
            row("fwd", 1024, {"flashop": flashop_1k_ms, "flash": 2.0, "cudnn": None}),  # cuDNN refused it
            row("fwd", 2048, {"flashop": 2.0, "flash": 2.0, "cudnn": 1.0}),
            row("bwd", 1024, {"flashop": 2.5, "flash": 5.0, "cudnn": 2.5}),
            row("fwd+bwd", 1024, {"flashop": 4.0, "flash": 4.0, "cudnn": 8.0}),
        ],
    }


def cpu_report():
    return {
        "format": bench.REPORT_FORMAT, "device": "cpu", "name": "Some CPU", "slug": "cpu", "date": "2000-01-02",
        "torch": "2.x", "threads": 2, "tokens": 4096, "rounds": 1, "peers": ["torch"], "config": None,
        "results": [row("fwd", 512, {"flashop": 10.0, "torch": 25.0}, dtype="fp32", d=64)],
    }


def table_rows(markdown, title):
    """The body rows (cells) of the table under the `### title` heading."""
    rows = []
    for line in markdown.split(f"### {title}\n", 1)[1].splitlines():
        if line.startswith("#"):
            break
        if line.startswith("|"):
            rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows[2:] if rows[1][0].startswith("---") else rows[1:]


def write(tmp_path, report):
    with open(tmp_path / f"bench_{report['slug']}.json", "w") as f:
        f.write(bench.report_json(report))


def test_report_tables_from_json(tmp_path):
    write(tmp_path, gpu_report())
    write(tmp_path, cpu_report())
    (tmp_path / "bench_other.json").write_text("[]")  # not a device report: ignored
    md = open(bench.render_docs(str(tmp_path))).read()
    assert md.startswith("# flashop benchmarks")
    assert "## Method" in md and "4·B·Hq·Sq·Sk·D" in md
    # GPUs first, then the CPU.
    assert md.index("## NVIDIA H100 80GB HBM3") < md.index("## CPU: Some CPU")
    assert "![NVIDIA H100 80GB HBM3](bench_h100.png)" in md and "(bench_cpu.png)" in md
    gpu = md.split("## NVIDIA H100 80GB HBM3", 1)[1].split("## CPU:", 1)[0]
    fwd = table_rows(gpu, "Forward")
    tflops = f"{BF16_D128_1K_FLOPS / 1e-3 / 1e12:.1f}"
    assert fwd[0] == ["bf16", "128", "False", "1024", "32x16", tflops, f"{BF16_D128_1K_FLOPS / 2e-3 / 1e12:.1f}", "-",
                      "2.00", "-"]
    assert fwd[1][-2:] == ["1.00", "0.50"]
    bwd = table_rows(gpu, "Backward")
    assert bwd[0][5] == f"{2.5 * BF16_D128_1K_FLOPS / 2.5e-3 / 1e12:.1f}" and bwd[0][-2:] == ["2.00", "1.00"]
    both = table_rows(gpu, "Forward + backward")
    assert both[0][-2:] == ["1.00", "2.00"]
    # Summary: harmonic means over seqlens; fwd vs FA2 over 2.0 and 1.0 is 4/3, vs cuDNN only 0.5 counts.
    summary = table_rows(gpu, "Summary")
    assert summary == [["bf16", "128", "False", "1.33", "0.50", "2.00", "1.00", "1.00", "2.00"]]
    assert "Timing: order balanced" in gpu
    cpu = md.split("## CPU: Some CPU", 1)[1]
    assert "Timing:" not in cpu and "GFLOP/s" in cpu and "2 threads" in cpu
    cpu_fwd = table_rows(cpu, "Forward")
    assert cpu_fwd[0][-1] == "2.50" and cpu_fwd[0][4] == "64x32"


def test_rerun_keeps_other_devices(tmp_path):
    pytest.importorskip("matplotlib")
    write(tmp_path, cpu_report())
    bench.write_report(gpu_report(), str(tmp_path), "bench_h100", markdown=False)
    bench.render_docs(str(tmp_path))
    bench.write_report(gpu_report(flashop_1k_ms=0.5), str(tmp_path), "bench_h100", markdown=False)  # a re-run
    md = open(bench.render_docs(str(tmp_path))).read()
    assert md.count("## NVIDIA H100") == 1 and "## CPU: Some CPU" in md
    assert table_rows(md.split("## CPU:")[0], "Forward")[0][-2] == "4.00"
    assert os.path.getsize(tmp_path / "bench_h100.png") > 1000
    assert json.load(open(tmp_path / "bench_h100.json"))["results"][0]["ms"]["flashop"] == 0.5


def test_tiny_cpu_benchmark_end_to_end(tmp_path):
    pytest.importorskip("matplotlib")
    pytest.importorskip("tqdm")
    results = bench.main(["--device", "cpu", "--dtypes", "fp32", "--headdims", "64", "--seqlens", "128", "--modes",
                          "fwd", "--causal", "false", "--tokens", "256", "--heads", "2", "--write-docs", str(tmp_path)])
    assert len(results) == 1 and all(ms > 0 for ms in results[0].ms.values())
    report = json.load(open(tmp_path / "bench_cpu.json"))
    assert report["device"] == "cpu" and report["peers"] == ["torch"] and len(report["results"]) == 1
    assert report["cpu_isa"] == flashop.cpu_isa()
    md = open(tmp_path / "benchmarks.md").read()
    assert f"flashop's {flashop.cpu_isa()} kernels" in md
    (fwd,) = table_rows(md, "Forward")
    assert fwd[:5] == ["fp32", "64", "False", "128", "2x2"]
    assert float(fwd[-1]) == pytest.approx(results[0].ms["torch"] / results[0].ms["flashop"], abs=0.01)
    assert os.path.getsize(tmp_path / "bench_cpu.png") > 1000


@pytest.mark.parametrize("impls", [["flashop", "flash", "cudnn"], ["flashop", "torch"], ["a", "b", "c", "d"]])
def test_timing_orders_balance_predecessors(impls):
    """Over 2n rounds every implementation runs in each and first in two of them; with three (the GPU sweep's),
    each follows each other one equally often within a round (a plain rotation keeps one predecessor for each)."""
    orders = bench.timing_orders(impls, 2 * len(impls))
    assert all(sorted(order) == sorted(impls) for order in orders)
    assert all(sum(order[0] == impl for order in orders) == 2 for impl in impls)
    if len(impls) == 3:
        follows = [(a, b) for order in orders for a, b in zip(order, order[1:])]
        assert {follows.count((a, b)) for a in impls for b in impls if a != b} == {2}


def test_variant_flops_count_the_visible_pairs():
    assert bench.visible_pairs(100, 100, True, -1, -1) == 100 * 101 // 2
    assert bench.visible_pairs(100, 100, False, -1, -1) == 100 * 100
    # A causal window of 10: 11 keys per row once the window is full, fewer for the first 10 rows.
    assert bench.visible_pairs(100, 100, True, 10, -1) == sum(min(i, 10) + 1 for i in range(100))
    # Sq < Sk, bottom-right aligned: row i sees keys up to i + 50.
    assert bench.visible_pairs(50, 100, True, -1, -1) == sum(i + 51 for i in range(50))
    case = bench.VariantCase("window 1024", "bf16", 128, 8192, 8192, 4, 16, "fwd")
    pairs = sum(min(i, 1024) + 1 for i in range(8192))
    assert case.flops() == 4.0 * 4 * 16 * pairs * 128


def test_variants_section_ratios():
    report = dict(cpu_report(), results=[], variants=[
        dict(variant="ALiBi", dtype="bf16", headdim=64, seqlen_q=512, seqlen_k=512, batch=1, heads=4, mode="fwd",
             flops=2e9, ms={"flashop": 10.0, "flex": 30.0}),
        dict(variant="sinks", dtype="bf16", headdim=64, seqlen_q=512, seqlen_k=512, batch=1, heads=4, mode="fwd",
             flops=2e9, ms={"flashop": 10.0}),
    ])
    markdown = bench.device_section(report)
    assert "| ALiBi | fwd | bf16 | 64 | 512 | 1x4 | 200.0 | 66.7 | 3.00 |" in markdown
    assert "| sinks | fwd | bf16 | 64 | 512 | 1x4 | 200.0 | - | - |" in markdown


def test_packed_lengths_fill_the_tokens():
    lengths = bench.packed_lengths(32768, 128, 4096)
    assert sum(lengths) == 32768 and max(lengths) <= 4096 and min(lengths[:-1]) >= 128
    assert lengths == bench.packed_lengths(32768, 128, 4096)  # a fixed draw


def test_varlen_section_ratios():
    row = dict(mode="fwd", dtype="bf16", headdim=128, heads=16, sequences=3, tokens=300, mean=100, max=150,
               flops={"flashop": 3e12, "varlen_attn": 3e12, "dense": 2e12}, ms={"flashop": 10.0, "varlen_attn": 20.0,
                                                                                "dense": 5.0})
    markdown = bench.device_section(dict(gpu_report(), results=[], varlen=[row]))
    assert "| fwd | bf16 | 128 | 16 | 3 (100, 150) | 300.0 | 150.0 | 2.00 | 400.0 | 0.75 |" in markdown


def test_decode_rows_and_section(monkeypatch):
    """--decode on tiny caches: every implementation runs (the peers may refuse), and the section gives GB/s of
    K/V read and flashop's ratios."""
    monkeypatch.setattr(bench, "DECODE_SHAPES", ((2, (256,)),))
    monkeypatch.setattr(bench, "median_ms", lambda fn, device: (fn(), 1.0)[1])
    args = bench.parse_args(["--device", "cpu", "--decode", "--no-sweep", "--heads", "8"])
    rows = bench.run_decode_cases(args)
    assert len(rows) == 1 and {"flashop", "flashop_page16", "flashop_page256", "copy"} <= rows[0]["ms"].keys()
    assert rows[0]["kv_bytes"] == 2 * 2 * 256 * 2 * 128 * 2
    row = dict(rows[0], ms={"flashop": 1e-3, "flashop_page16": 2e-3, "flashop_page256": 1e-3, "flash": 2e-3,
                            "cudnn": 4e-3, "copy": 5e-4})  # 524288 bytes: 524 GB/s at 1 us
    markdown = bench.device_section(dict(gpu_report(), results=[], decode=[row]))
    assert "| 2 | 256 | 8/2 | 128 | 524 | 262 | 524 | 262 | 131 | 1049 | 2.00 | 4.00 |" in markdown


def test_overhead_rows_and_section(monkeypatch):
    """--overhead: both implementations run in every region and mode (each call really runs: the timer is
    replaced by one call), and the section gives torch's time over flashop's."""
    calls = []
    monkeypatch.setattr(bench, "_wall_us_per_call", lambda fn, device: (calls.append(fn()), 10.0)[1])
    args = bench.parse_args(["--device", "cpu", "--overhead", "--no-sweep"])
    rows = bench.run_overhead_cases(args)
    assert [(r["region"], r["mode"]) for r in rows] == [("eager", "fwd"), ("eager", "fwd+bwd"), ("compiled", "fwd"),
                                                        ("compiled", "fwd+bwd")]
    assert all(r["us"].keys() == {"flashop", "torch"} for r in rows) and len(calls) == 8
    assert tuple(calls[0].shape) == bench.OVERHEAD_SHAPE  # the forward's output
    row = dict(rows[0], us={"flashop": 40.0, "torch": 50.0})
    markdown = bench.device_section(dict(gpu_report(), results=[], overhead=[row]))
    assert "| eager | fwd | float32 | 40.0 | 50.0 | 1.25 |" in markdown
