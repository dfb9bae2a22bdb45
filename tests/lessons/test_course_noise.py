"""ddp_course.course.noise: the verdict of a comparison follows the repeats, never one lucky median."""

from ddp_course import bench
from ddp_course.course import noise


def test_separated_ranges_give_a_direction():
    c = noise.compare([1.0, 1.1, 1.2], [2.0, 2.1, 2.2])
    assert c["verdict"] == "faster" and c["resolved"] and abs(c["ratio"] - 1.1 / 2.1) < 1e-12
    assert noise.compare([2.0, 2.1], [1.0, 1.1])["verdict"] == "slower"


def test_overlapping_ranges_give_no_direction_even_with_different_medians():
    c = noise.compare([1.0, 1.5, 3.0], [1.4, 2.0, 2.5])  # medians 1.5 vs 2.0, but the ranges overlap
    assert c["verdict"] == noise.UNRESOLVED and not c["resolved"]


def test_speeds_read_the_other_way_round():
    assert noise.compare([200.0, 210.0], [100.0, 110.0], higher_is_faster=True)["verdict"] == "faster"
    assert noise.compare([200.0, 210.0], [100.0, 110.0])["verdict"] == "slower"


def test_sentence_names_medians_ranges_and_verdict():
    s = noise.sentence("a", [0.010, 0.011, 0.012], "b", [0.020, 0.021], scale=1e3)
    assert s.startswith("a 11.0 ms (10.0-12.0 over 3) vs b 20.5 ms (20.0-21.0 over 2): 0.54x, a faster"), s
    assert noise.sentence("a", [1.0, 3.0], "b", [2.0]).endswith(noise.UNRESOLVED)


# --------------------------------------------------------------------------------------------------
# Measurements that cannot be read, and winners among several


def test_repeats_that_differ_several_fold_are_a_disturbed_run():
    # lesson 01 once committed a one-process baseline whose intervals spanned 1,988-25,046 tokens/s
    c = noise.compare([24_693, 17_774, 28_835], [4_202, 1_988, 25_046], higher_is_faster=True)
    assert c["disturbed"] and not c["resolved"] and c["verdict"].startswith(noise.DISTURBED)
    assert "12.6x" in c["verdict"]
    assert not noise.compare([1.0, 1.5], [2.0, 2.9])["disturbed"]  # within SPREAD_LIMIT


def test_a_speed_up_beyond_the_processes_is_a_disturbed_run():
    s = noise.sentence("two", [23_000, 24_000, 25_000], "one", [3_500, 3_600, 3_700], unit="tok/s",
                       higher_is_faster=True, workers=2)
    assert noise.DISTURBED in s and "at most 2x" in s and "faster" not in s
    assert noise.disturbed(speedup=6.63, workers=2, cores=2)
    assert noise.disturbed(speedup=3.5, workers=4, cores=2)  # 4 processes on 2 cores: at most 2x
    assert noise.disturbed(speedup=2.1, workers=2, cores=8) is None  # within SPEEDUP_SLACK
    assert noise.disturbed(speedup=1.9, workers=2, cores=2) is None
    # times: a speed-up of a over b is b / a
    assert noise.compare([1.0, 1.0], [3.0, 3.0], workers=2)["disturbed"]


def test_ranking_names_a_winner_only_when_its_range_clears_every_other():
    clear = noise.ranking({"x": [1.0, 1.1], "y": [2.0, 2.2], "z": [3.0, 3.1]})
    assert clear["resolved"] and clear["best"] == "x" and clear["verdict"].startswith("fastest: x")
    # lesson 05's sweep once printed "fastest: bucket_cap_mb=0.25" from these overlapping ranges
    tied = noise.ranking({"0.05": [44.8, 44.9, 51.4], "0.25": [32.3, 34.1, 58.2], "1": [34.6, 36.3, 41.1],
                          "25": [38.8, 39.8, 44.0]})
    assert not tied["resolved"] and tied["best"] == "0.25" and tied["tied"] == ["0.05", "1", "25"]
    assert "fastest" not in tied["verdict"] and "no difference this machine resolves" in tied["verdict"]
    speeds = noise.ranking({"a": [10.0, 11.0], "b": [20.0, 21.0]}, higher_is_faster=True)
    assert speeds["best"] == "b" and speeds["resolved"]
    assert noise.ranking({"a": [1.0, 9.0], "b": [2.0, 2.1]})["disturbed"]


def test_the_bucket_sweep_names_no_winner_from_overlapping_rounds():
    from ddp_course.course.l05_inside_ddp import bench_buckets

    def row(cap, n, ts):
        return {"bucket_cap_mb": cap, "allreduces_per_step": n, "step_ms": ts, "median_ms": sorted(ts)[1],
                "min_ms": min(ts), "max_ms": max(ts)}

    result = {"model_bytes": 1.58 * 2**20, "world_size": 2, "backend": "gloo", "device": "cpu", "threads_per_rank": 1}
    overlapping = bench_buckets.table({**result, "rows": [row(0.05, 9, [44.8, 44.9, 51.4]), row(0.25, 7, [32.3, 34.1, 58.2])]})
    assert "fastest" not in overlapping and "no difference this machine resolves" in overlapping
    clear = bench_buckets.table({**result, "rows": [row(0.05, 9, [44.8, 44.9, 45.4]), row(0.25, 7, [32.3, 34.1, 35.2])]})
    assert "fastest: bucket_cap_mb=0.25" in clear


def _gil(cores, threaded, sequential):
    return {"threads": 2, "torch": {"cores": cores, "cores_sequential": 1.0, "threaded_rounds_s": threaded,
                                    "sequential_rounds_s": sequential}}


def test_the_gil_verdict_rests_on_both_occupancy_and_speed():
    from ddp_course.course.l03_data_parallel.dp_mechanism import matmul_verdict

    # lesson 03 once printed "the kernels ran side by side" beside a 1.01x speed-up
    busy_not_sooner = matmul_verdict(_gil(1.65, [0.0158, 0.0160, 0.0155], [0.0159, 0.0150, 0.0161]))
    assert "no difference this machine resolves" in busy_not_sooner and "finished no sooner" in busy_not_sooner
    assert "ran side by side" not in busy_not_sooner
    both = matmul_verdict(_gil(1.9, [0.060, 0.061, 0.062], [0.105, 0.106, 0.107]))
    assert "ran side by side" in both
    idle = matmul_verdict(_gil(1.05, [0.10, 0.10], [0.10, 0.11]))
    assert "no second core was free" in idle
    assert noise.DISTURBED in matmul_verdict(_gil(1.9, [0.01, 0.09], [0.10, 0.11]))


def test_the_benchmarks_and_the_notebooks_call_the_same_repeats_disturbed(capsys):
    """One threshold (bench.DISTURBED_SPAN, justified there): a benchmark warns exactly when a notebook's
    verdict would say the same repeats cannot be read."""
    assert noise.SPREAD_LIMIT is bench.DISTURBED_SPAN
    for repeats in ([100.0, 110.0, 150.0], [100.0, 290.0], [100.0, 310.0], [100.0, 0.0]):
        warned = bench.noise_warning("probe", bench.span(repeats), "rerun.", load=[0.0])
        assert warned == bool(noise.disturbed({"the probe": repeats})), repeats
        assert ("warning: [probe]" in capsys.readouterr().out) == warned
