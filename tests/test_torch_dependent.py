"""The selection of ``make test-ipex`` (tests/torch_dependent.py): what it collects and keeps,
and that an entry which selects nothing fails the run instead of leaving torch 2.8 untested."""

from __future__ import annotations

import pytest

from tests.torch_dependent import SUITES, may_hold_any, select

DECODER = "tests/models/test_decoder_parity.py::test_prefill_and_decode_logits_match_transformers"


def test_only_the_listed_files_and_their_directories_are_collected():
    assert may_hold_any("tests") and may_hold_any("tests/models")
    assert may_hold_any("tests/backends/test_ipex.py")  # inside a listed directory
    assert may_hold_any("tests/lowering/test_export.py")
    assert not may_hold_any("tests/serve") and not may_hold_any("tests/serve/test_x.py")
    assert not may_hold_any("tests/lowering/test_bodies.py")
    # a file whose name starts with a listed one's stem is another file
    assert may_hold_any("tests/runtime/test_engine.py")
    assert not may_hold_any("tests/runtime/test_engine_text.py")


def test_a_listed_case_keeps_only_its_representative():
    ids = [
        f"{DECODER}[gemma3-qknorm-localrope-window-eager]",
        f"{DECODER}[llama-gqa-llama3rope-bias-eager]",
        "tests/fuzz/test_fuzz_ops.py::test_fuzz[ipex-paged_attention-well_formed]",
        "tests/fuzz/test_fuzz_ops.py::test_fuzz[onnx-native-paged_attention-well_formed]",
        "tests/custom_ops/test_opcheck.py::test_opcheck[paged_attention]",
    ]
    assert select(ids, whole_suite=False) == [True, False, True, False, True]


def test_an_entry_that_selects_nothing_of_the_whole_suite_is_named():
    everything_but_one = [
        f"{entry}::test[{only[0] if only else ''}]"
        for entry, only in SUITES.items()
        if "test_rope" not in entry
    ]
    assert select(everything_but_one, whole_suite=False)  # a part of the suite: no check
    with pytest.raises(LookupError, match=r"no test matches \['tests/models/test_rope.py'\]"):
        select(everything_but_one, whole_suite=True)
