"""ddp_course.course.noise: the verdict of a comparison follows the repeats, never one lucky median."""

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
