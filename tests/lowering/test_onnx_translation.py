"""torch.onnx's translation without its decomposition retrace (lowering/onnx_translation.py):
taken for programs whose every op has a translation, giving the file the retrace gives (the
same onnxruntime results, bit for bit), and refused, with the reason, for anything it would
translate differently: in-place ops on intermediates, caches read by other ops, ops without a
translation of their own."""

from __future__ import annotations

import pytest
import torch

from attnexport.lowering import PagedOrtSession, export_program, onnx_translation, to_onnx
from attnexport.lowering.passes import functionalize_cache_writes
from attnexport.tolerances import tolerance
from tests.lowering.modules import (
    AttentionStack,
    LayerOptions,
    PagedAttentionOnly,
    StepPlanner,
    attention_inputs,
)

BLOCK_SIZE = 4


@pytest.fixture
def translations(monkeypatch) -> list[bool]:
    """Whether each ``to_onnx`` of the test skipped the retrace, in order."""
    used: list[bool] = []
    translate = onnx_translation.translate

    def recording(*args, **kwargs):
        model, direct = translate(*args, **kwargs)
        used.append(direct)
        return model, direct

    monkeypatch.setattr(onnx_translation, "translate", recording)
    return used


def _retrace_forced(monkeypatch) -> None:
    monkeypatch.setattr(onnx_translation, "direct_blockers", lambda *_: ["forced by the test"])


def _stack_inputs(planner: StepPlanner, plan: dict[int, int], padding: int, seed: int) -> dict:
    step = planner.step(plan, padding)
    generator = torch.Generator().manual_seed(seed)
    tokens = int(step["query_start_loc"][-1])
    states = torch.randn(tokens + padding, 24, generator=generator)
    return {"hidden": states[:tokens].clone(), "key_states": states, **step}


def _caches(count: int, num_blocks: int, kv_heads: int = 2, head_size: int = 8) -> list:
    generator = torch.Generator().manual_seed(5)
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_size)
    return [torch.randn(shape, generator=generator) for _ in range(count)]


def test_a_decoder_stack_skips_the_retrace_and_runs_as_with_it(tmp_path, translations, monkeypatch):
    layers = (LayerOptions(), LayerOptions(alibi=True, logits_soft_cap=3.0))
    stack = AttentionStack(layers)
    sample = _stack_inputs(StepPlanner(8, BLOCK_SIZE, seed=3), {0: 3, 1: 5}, 2, seed=0)
    args = (*sample.values(), _caches(4, 8))
    program = export_program(stack, args)
    to_onnx(program, args, tmp_path / "direct.onnx")
    _retrace_forced(monkeypatch)
    to_onnx(program, args, tmp_path / "retraced.onnx")
    assert translations == [True, False]

    sessions = [PagedOrtSession(tmp_path / f"{name}.onnx") for name in ("direct", "retraced")]
    planner = StepPlanner(32, BLOCK_SIZE, seed=1)
    eager_caches = _caches(4, 32)
    onnx_caches = [[c.clone() for c in eager_caches] for _ in sessions]
    for index, (plan, padding) in enumerate([({0: 7, 1: 4}, 2), ({0: 1, 1: 1}, 1)]):
        inputs = _stack_inputs(planner, plan, padding, seed=10 + index)
        with torch.no_grad():
            expected = stack(*inputs.values(), eager_caches)
        direct, retraced = (
            session.run({**inputs, "kv_caches": caches})["output"]
            for session, caches in zip(sessions, onnx_caches, strict=True)
        )
        torch.testing.assert_close(direct, retraced, atol=0, rtol=0)
        torch.testing.assert_close(direct, expected, **tolerance(torch.float32))
        for ours, theirs in zip(*onnx_caches, strict=True):
            torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def _decomposed_ops(out, _cache):
    """Ops with no translation of their own, which the retrace decomposes."""
    wide = out.to(torch.float64).detach()
    mask = (out > 0.0) & (out < 1.0) | (out < -1.0)
    squares = torch.square(torch.min(wide, wide.flip(0)))
    return torch.where(mask, squares, -squares)


def _mixed_dtypes(out, _cache):
    """An integer tensor added to a float one: torch.onnx's type promotion casts it."""
    return out + (out > 0).to(torch.int64) * 3


def _in_place_on_an_intermediate(out, _cache):
    return out.div_(2) + 1


def _cache_read_after_its_write(out, cache):
    return out + cache.sum()


def _export_and_run(module, tmp_path) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """The retrace's blockers for ``module``; its ONNX file's output and eager's on a step."""
    planner = StepPlanner(16, BLOCK_SIZE)
    sample = attention_inputs(planner.step({0: 5, 1: 3}, padding=1), 1)
    caches = _caches(2, 16)
    program = export_program(module, (*sample.values(), *caches))
    blockers = onnx_translation.direct_blockers(
        functionalize_cache_writes(program)[0], _translated_by_torch_onnx()
    )
    to_onnx(program, (), tmp_path / "m.onnx")
    step = attention_inputs(planner.step({0: 1, 1: 2}, padding=2), 2, seed=4)
    eager_caches = [c.clone() for c in caches]
    with torch.no_grad():
        expected = module(*step.values(), *eager_caches)
    names = {"key_cache": caches[0], "value_cache": caches[1]}
    got = PagedOrtSession(tmp_path / "m.onnx").run({**step, **names})["output"]
    return blockers, got, expected


def _translated_by_torch_onnx():
    from torch.onnx._internal.exporter import _registration

    from attnexport.lowering.registry import translation_table

    registry = _registration.ONNXRegistry.from_torchlib()
    for op, translation in translation_table().items():
        registry.register_op(op, translation)
    return registry.is_registered


@pytest.mark.parametrize(
    ("after", "promotes"),
    [(_decomposed_ops, False), (_mixed_dtypes, True)],
    ids=["decomposed-ops", "mixed-dtypes"],
)
def test_programs_with_a_translation_for_every_op_skip_the_retrace(
    tmp_path, translations, monkeypatch, after, promotes
):
    """Ops the retrace would decompose translate as their decomposition; the type promotion
    pass runs where it has something to cast, and only there."""
    promotions = []
    needs = onnx_translation.needs_type_promotion
    monkeypatch.setattr(
        onnx_translation,
        "needs_type_promotion",
        lambda module: promotions.append(needs(module)) or promotions[-1],
    )
    blockers, got, expected = _export_and_run(PagedAttentionOnly(after=after), tmp_path)
    assert blockers == [] and translations == [True] and promotions == [promotes]
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))


@pytest.mark.parametrize(
    ("after", "blocker"),
    [
        (_in_place_on_an_intermediate, "in-place aten.div_.Tensor"),
        (_cache_read_after_its_write, "cache key_cache read by aten.sum.default"),
    ],
    ids=["in-place-op", "cache-read-by-another-op"],
)
def test_programs_it_would_translate_differently_take_the_retrace(
    tmp_path, translations, after, blocker
):
    blockers, got, expected = _export_and_run(PagedAttentionOnly(after=after), tmp_path)
    assert blockers == [blocker] and translations == [False]
    torch.testing.assert_close(got, expected, **tolerance(torch.float32))
