"""The integer fast path of the math reward gives math-verify's verdict wherever it applies."""

import itertools

from megatron_zcpo.rewards.math import _integer_verdict, math_answer_is_correct, math_verify_verdict

GROUND_TRUTHS = ["7", "-3", "0", "124", "+5", " 12 ", "007", "10", "1/2", "3.5", "x+1"]
RESPONSES = [
    "\\boxed{7}",
    "\\boxed{ 7 }",
    "\\boxed{+7}",
    "\\boxed{007}",
    "\\boxed{-3}",
    "\\boxed{- 3}",
    "\\boxed{-0}",
    "so x \\boxed{124} y",
    "\\boxed{12}4",
    "\\boxed{1}\\boxed{7}",
    "\\boxed{7.0}",
    "\\boxed{124}}",
    "\\boxed{{124}}",
    "\\boxed{10}",
    "\\boxed{1 0}",
    "\\boxed{0}",
    "Answer: 5",
    "\\boxed{12} ",
    "\\boxed{5}<|im_end|>",
    "\\boxed{",
    "7",
    "\\boxed{\\frac{1}{2}}",
    "\\boxed{3.5}",
]


def test_fast_path_agrees_with_math_verify():
    applied = 0
    for truth, response in itertools.product(GROUND_TRUTHS, RESPONSES):
        expected = math_verify_verdict(response, truth)
        assert math_answer_is_correct(response, truth) == expected, (response, truth)
        fast = _integer_verdict(response, truth)
        if fast is not None:
            applied += 1
            assert fast == expected, (response, truth)
    assert applied > 50  # the fast path covers the plain-integer cases


def test_fast_path_leaves_non_integers_to_math_verify():
    assert _integer_verdict("\\boxed{1/2}", "1/2") is None
    assert _integer_verdict("\\boxed{0.5}", "1/2") is None
    assert _integer_verdict("\\boxed{1}\\boxed{2}", "2") is None  # two boxes: math-verify decides which
    assert _integer_verdict("Answer: 5", "5") is None
    assert math_answer_is_correct("\\boxed{0.5}", "1/2")
