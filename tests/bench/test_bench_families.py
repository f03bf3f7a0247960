"""bench.families' decisions: the variants it runs for a default, ratios taken within a round, a
variant over its time limit left out of its round (not taken for a break), and what it turns off.
"""

from bench.families import _ratio, flips, variant_of, verdict

KEY = "images_per_cpu_sec"
ALL_ON = {"amp": True, "channels_last": True, "conv_gemm": True, "compile": False}


def test_each_choice_is_flipped_from_the_default_the_others_kept():
    assert variant_of(ALL_ON) == "bf16+conv-gemm"
    assert flips(ALL_ON) == {"amp": ("bf16+conv-gemm", "channels-last+conv-gemm"),
                             "channels_last": ("bf16+conv-gemm", "bf16-nchw+conv-gemm"),
                             "conv_gemm": ("bf16+conv-gemm", "bf16"),
                             "compile": ("bf16+conv-gemm+compile-nchw", "bf16+conv-gemm")}
    fp32 = {**ALL_ON, "amp": False, "channels_last": False}
    assert variant_of(fp32) == "conv-gemm" and variant_of({**fp32, "conv_gemm": False}) == "nchw"


def test_ratios_pair_rounds_and_a_timeout_leaves_its_round_out():
    runs = {"on": [{KEY: 8.0}, {KEY: 9.0}, {KEY: 6.0}],
            "off": [{KEY: 10.0}, {"error": "not done in 600 s (--variant-timeout)"}, {KEY: 5.0}]}
    ratio, spread = _ratio(runs, "on", "off", KEY)
    assert ratio == (0.8 + 1.2) / 2 and spread == " (0.80-1.20)"
    assert verdict((ratio, spread), on_by_default=True) is None  # 1.0: a tie stays on


def test_a_choice_on_by_default_that_loses_or_breaks_is_turned_off():
    runs = {"on": [{KEY: 7.0}, {KEY: 8.0}], "off": [{KEY: 10.0}, {KEY: 10.0}]}
    assert verdict(_ratio(runs, "on", "off", KEY), on_by_default=True) == "loses: 0.75x"
    assert verdict(_ratio(runs, "on", "off", KEY), on_by_default=False) is None  # off already
    broken = {"on": [{"error": "RuntimeError: no kernel"}], "off": [{KEY: 10.0}]}
    assert verdict(_ratio(broken, "on", "off", KEY), True).startswith("breaks: on: RuntimeError")
    noop = {"on": [{KEY: 1.0}], "off": [{"error": "no-op: no one-pixel convolution"}]}
    assert verdict(_ratio(noop, "on", "off", KEY), True) is None


def test_compile_pays_back_its_first_step_after_the_images_its_faster_steps_save():
    from bench.families import payback

    runs = {"conv-gemm+compile-nchw": [{"first_step_s": 101.0, "images_per_sec": 20.0}],
            "conv-gemm": [{"first_step_s": 1.0, "images_per_sec": 10.0}, {"images_per_sec": 9}]}
    said = payback(runs, "conv-gemm+compile-nchw", "conv-gemm")
    # +100 s; each image 0.1 s eager, 0.05 s compiled: 100 / 0.05 = 2,000 images
    assert "+100 s" in said and "2.00x" in said and "after 2,000 images" in said
    runs["conv-gemm+compile-nchw"][0]["images_per_sec"] = 10.1  # within 2%: no gain
    assert payback(runs, "conv-gemm+compile-nchw", "conv-gemm").endswith("never pays back "
                                                                         "(no faster within 2%)")
    runs["conv-gemm+compile-nchw"] = [{"error": "not done in 900 s (--variant-timeout)"}]
    assert payback(runs, "conv-gemm+compile-nchw", "conv-gemm") is None
